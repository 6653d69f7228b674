"""specdistill's Hydra entry point in a checkout; installed, the same is the `specdistill-train` console script.

    python train.py                                   # the embedded default pipeline on CPU
    python train.py stage=sft task=gsm8k models=pythia_31m_to_1.4b trainer=gpu
    python train.py -m stage=adaspec adaspec.reference=<distill_run>/export adaspec.k=0.2,0.4,0.8

The code lives in `specdistill/cli.py`; the configs in `conf/` (packaged as `specdistill/conf`).
"""

from specdistill.cli import train

if __name__ == "__main__":
    train()
