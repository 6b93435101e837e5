"""The tools around training: what users look at and measure, apart from
the core.

    bench.py     `distribuuuu bench`: model, data loader and whole-step timings of one process
    scaling.py   `distribuuuu bench --scaling 1,2,4`: the same run with each process count
    compare.py   `distribuuuu bench --compare single,dp,ddp,ddp+amp`: one job trained each way
    runner.py    the sweeps' one way to start a `distribuuuu train` child and read how it ended
    plot.py      `distribuuuu plot`: learning curves from metrics.jsonl
    predict.py   `distribuuuu predict`: top-k classes of image files (a checkpoint, or --model an
                 exported file)
    export.py    `distribuuuu export`: torch.export, ONNX and safetensors files (TorchScript on
                 request), each checked
    calibrate.py `distribuuuu calibrate`: a checkpoint's temperature (calibration.py) on demand

Tools import the core (config, data, models, engine, dist); the core
never imports a tool, and no tool imports cli.py (cli.py imports each
tool lazily, when its command runs). This file imports nothing, so that
one tool loads only what it needs.
"""
