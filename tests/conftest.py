import os
import sys

# the party processes import test programs from this directory (tests/parties.py)
sys.path.insert(0, os.path.dirname(__file__))
