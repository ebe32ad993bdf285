import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Runs inside the pytest process must match script runs in subprocesses (helpers.py gives them
# OMP_NUM_THREADS=1) bit for bit, and a different thread count can change float reductions.
torch.set_num_threads(1)
