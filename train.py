"""``python train.py attention=vq_soft ...``: the trainer's command line (the same as the ``vqattn-train`` script).

Everything lives in :mod:`vqattn.train.cli` (imported by :mod:`vqattn.train.entry`, which makes a Ctrl-C during
the imports one line); its configs are vqattn/train/conf/.
"""

from vqattn.train.entry import main

if __name__ == "__main__":
    main()
