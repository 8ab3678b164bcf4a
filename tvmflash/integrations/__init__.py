"""Integrations of tvmflash with other libraries (each an optional dependency, imported on use).

* ``tvmflash.integrations.transformers``: Hugging Face transformers' attention interface
  (``pip install tvmflash[hf]``).
"""
