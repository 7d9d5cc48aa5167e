"""``tachyon train``: the main job, a small BERT (masked LM) or GPT trained with the tachyon engine
on the Shakespeare corpus that ships with the package, scored against the unigram baseline.

    tachyon train [CONFIG] [--model gpt] [--pld] [--resume] [--nproc N] [--steps N] [--output-dir DIR] [--quiet]
    python -m tachyon.train ...           the same command

Pieces: :mod:`tachyon.train.config` (the job's JSON: model size, steps, evaluation and checkpoint
intervals, output dir, and the DeepSpeed-style ``engine`` section), :mod:`tachyon.train.models`
(BertMLM from the fused transformer kernel layer, GPT from ``tachyon.nn.TransformerLayer``),
:mod:`tachyon.train.run` (the loop), :mod:`tachyon.train.evaluate` (validation loss, unigram
baseline, fill-mask, generation), :mod:`tachyon.train.report` (CSVs, table, summary.txt),
:mod:`tachyon.train.plot` (loss.png with matplotlib), :mod:`tachyon.train.helpers` and
:mod:`tachyon.train.cli` (arguments and the torchrun re-launch). matplotlib and tokenizers (the
``train`` extra) are imported only when the job runs.
"""

from tachyon.train.config import TrainConfig, load_train_config

__all__ = ["TrainConfig", "load_train_config"]
