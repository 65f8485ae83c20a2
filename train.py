"""``python train.py attention=vq_soft ...``: the trainer's command line (the same as the ``vqattn-train`` script).

Everything lives in :mod:`vqattn.train.cli`; its configs are vqattn/train/conf/.
"""

from vqattn.train.cli import main

if __name__ == "__main__":
    main()
