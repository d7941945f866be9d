"""Evaluate a drafter by replaying stored states: acceptance length tau (issue 4; not built yet)."""

import sys

if __name__ == "__main__":
    sys.exit("error: evaluate.py is not implemented yet (issue 4); stage one is `pipeline extract`")
