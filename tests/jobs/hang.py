"""A job in which rank 3 stops joining collectives (tests/test_multinode.py runs it under two torchrun agents):
every rank all-reduces once, then rank 3 sleeps where the others all-reduce again."""
import time

import torch

import globaltensor as gt

p = gt.placement("cpu", [[0, 1], [2, 3]])
x = gt.to_global(torch.ones(8), p, (gt.partial_sum, gt.partial_sum))
x.to_global(p, (gt.broadcast, gt.broadcast))
if gt.rank() == 3:
    time.sleep(120)  # stuck: its watcher thread still answers
x.to_global(p, (gt.broadcast, gt.broadcast))
