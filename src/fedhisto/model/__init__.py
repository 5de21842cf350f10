"""The frozen encoder and the trainable PEFT pathway (LoRA, residual adapter, FiLM, classifier)."""
