"""The reference trainer: a Llama-style decoder under real DP x TP x PP (run ``python -m tenplex.train``)."""

from .memory_probe import measure_step_memory
from .run import main, parse_args  # not run(): tenplex.train.run stays the module
from .schedule import Op, bubble_fraction, one_f_one_b
from .trainer import TrainConfig, Trainer, trainer_ptc

__all__ = ["Op", "bubble_fraction", "one_f_one_b", "TrainConfig", "Trainer", "main", "parse_args", "trainer_ptc",
           "measure_step_memory"]
