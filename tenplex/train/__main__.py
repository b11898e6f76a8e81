import sys

from torch.distributed.elastic.multiprocessing.errors import record

from .trainer import main

sys.exit(record(main)())
