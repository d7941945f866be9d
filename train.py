"""Stage two: train a DFlash drafter from a hidden-state store (issue 3; not built yet)."""

import sys

if __name__ == "__main__":
    sys.exit("error: train.py is not implemented yet (issue 3); stage one is `pipeline extract`")
