import sys

from torch.distributed.elastic.multiprocessing.errors import record

from .run import main

sys.exit(record(main)())
