"""The reference trainer: a Llama-style decoder under real DP x TP x PP (run ``python -m tenplex.train``)."""

from .schedule import Op, bubble_fraction, one_f_one_b
from .trainer import TrainConfig, Trainer, main, trainer_ptc

__all__ = ["Op", "bubble_fraction", "one_f_one_b", "TrainConfig", "Trainer", "main", "trainer_ptc"]
