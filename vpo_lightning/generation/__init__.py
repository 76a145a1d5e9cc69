"""Generation: loading models and tokenizers, the rollout engines and their decode loop, adapter folders.

transformers, peft and vLLM live here; nothing here imports Lightning. docs/ARCHITECTURE.md lists the modules.
"""
