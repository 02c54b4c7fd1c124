"""Installs the fault named in INGOT_TEST_FAULT in every Python process started with this
directory on PYTHONPATH (tests/faults.py's child_env): the children a test cannot patch."""

import os
import sys

if os.environ.get("INGOT_TEST_FAULT"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import faults

    faults.install_from_env()
