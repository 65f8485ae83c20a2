"""Hugging Face integration (``pip install "vqattn[hf]"``): vqattn models as transformers models.

* :class:`VQAttnConfig` (``model_type="vqattn"``) and :class:`VQAttnForCausalLM`, which wraps the project's own
  :class:`vqattn.model.GPT` and generates with its recurrent state as the cache (:class:`VQAttnCache`);
* :class:`VQAttnByteTokenizer`, the byte vocabulary;
* ``vqattn-export`` (:mod:`vqattn.hf.export`): a trainer checkpoint to a ``save_pretrained`` directory;
* ``vqattn-eval`` (:mod:`vqattn.hf.eval`): lm-evaluation-harness with these classes registered and the tasks
  of :mod:`vqattn.hf.tasks`.

Importing this package registers the classes with AutoConfig, AutoModel, AutoModelForCausalLM and
AutoTokenizer, so ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load an exported directory offline. Only this package imports transformers: the rest of vqattn needs torch.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .configuration import VQAttnConfig
from .modeling import VQAttnCache, VQAttnForCausalLM
from .tokenizer import VQAttnByteTokenizer

AutoConfig.register(VQAttnConfig.model_type, VQAttnConfig, exist_ok=True)
AutoModel.register(VQAttnConfig, VQAttnForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(VQAttnConfig, VQAttnForCausalLM, exist_ok=True)
AutoTokenizer.register(VQAttnConfig, tokenizer_class=VQAttnByteTokenizer, exist_ok=True)

__all__ = ["VQAttnByteTokenizer", "VQAttnCache", "VQAttnConfig", "VQAttnForCausalLM"]
