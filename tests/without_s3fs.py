"""`pipeline ARGS`, `python train.py ARGS` or `python evaluate.py ARGS` as on an install without s3fs
(a plain `pip install -e .`), whether or not this environment has it:

    python -m tests.without_s3fs pipeline|train|evaluate ARGS...

The import of s3fs fails as it fails where the package is missing; everything else is the real command."""

import sys

sys.modules["s3fs"] = None  # `import s3fs` raises ImportError, as without the package
PROGRAM = sys.argv.pop(1)
if PROGRAM == "pipeline":
    from pipeline.cli import main

    main()
else:
    from stages.command import run_command

    module = __import__(PROGRAM)
    run_command(module.main)
