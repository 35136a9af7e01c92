"""Dense GQA transformers (``deepseek-llm-67b``), for ``flashrt plan`` comparisons only."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DenseConfig:
    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    inter_dim: int
    vocab_size: int
    kv_dtype_bytes: int = 2  # bf16 cache

    def params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.inter_dim
        return self.n_layers * (attn + mlp + 2 * self.dim) + 2 * self.vocab_size * self.dim + self.dim

    def kv_bytes_per_token(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.kv_dtype_bytes

    def decode_flops(self, context: int) -> int:
        """Per token: 2 per weight multiply-add, plus QK and PV over the context."""
        return 2 * self.params() + 4 * self.n_layers * self.n_heads * self.head_dim * context


DENSE = {
    "deepseek-llm-67b": DenseConfig("deepseek-llm-67b", n_layers=95, dim=8192, n_heads=64, n_kv_heads=8,
                                    head_dim=128, inter_dim=22016, vocab_size=102400),
}
