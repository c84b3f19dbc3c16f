"""Attention: functional API, autograd, backend choice."""

from .interface import attention, attention_backward, attention_forward

__all__ = ["attention", "attention_forward", "attention_backward"]
