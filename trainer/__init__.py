"""Training behind ``graphopt run``.

Modules:
  training_graph  the run's training graph: graphopt.training's TrainingGraph (built by
                  graphopt.training.prepare_training) + starting weights, checkpoint identity
  precision       fp32 | mixed | fp16: master and compute dtypes
  data            .npz arrays -> batches in a seeded per-epoch order
  optimizers      SGD, momentum, AdamW (PyTorch's formulas)
  loss_scaling    none, static:N, dynamic
  loop            one executor run per step, the update, Ctrl-C, checkpoint cadence
  checkpoint      atomic checkpoints for an exact --resume
  progress        progress bar / plain lines, CSV or JSONL step log
  export          trained model (forward graph, new weights) and the loss plot
  runner          RunOptions -> the whole run (what the CLI calls)
"""
from graphopt.layout import refuse_second_name

refuse_second_name(__name__, "trainer")

from .loop import Trainer, TrainResult
from .runner import RunOptions, RunOutcome, run
from .training_graph import RunGraph, build

__all__ = ["RunOptions", "RunOutcome", "TrainResult", "Trainer", "RunGraph", "build", "run"]
