"""The lab's model: a real Qwen3 architecture, small enough to train from scratch on a CPU."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from opd.lab.tokenizer import newline_id


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(192, gt=0, description="width of the residual stream")
    num_hidden_layers: int = Field(4, gt=0, description="transformer blocks")
    num_attention_heads: int = Field(6, gt=0, description="query heads")
    num_key_value_heads: int = Field(2, gt=0, description="key/value heads (GQA)")
    intermediate_size: int = Field(512, gt=0, description="MLP width")
    max_position_embeddings: int = Field(64, gt=0, description="longest prompt + answer, in tokens (characters "
                                         "with the char tokenizer)")

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("hidden_size must divide by num_attention_heads, and heads by num_key_value_heads")
        return self


def build_model(shape: ModelShape, tokenizer: PreTrainedTokenizerBase, seed: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    # Answers end with a newline: generation stops there as well as on <eos>.
    model.generation_config.eos_token_id = [newline_id(tokenizer), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
