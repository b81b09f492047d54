"""Hugging Face transformers made from their configurations (random weights, nothing downloaded), for the sweeps:
``python benchmarks/sweep.py --models benchmarks/hf_models.py:bert benchmarks/hf_models.py:gpt2
benchmarks/hf_models.py:t5_encoder``. Each factory returns the model and its example inputs: a batch of one sequence
of 128 tokens. Needs ``pip install transformers``."""

import torch

SEQUENCE = 128


def _tokens(vocabulary: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocabulary, (1, SEQUENCE), generator=torch.Generator().manual_seed(0)),)


class _Hidden(torch.nn.Module):
    """A transformer's forward on token ids, returning its last hidden states (or logits) as one tensor."""

    def __init__(self, model: torch.nn.Module, field: str):
        super().__init__()
        self.model, self.field = model, field

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(input_ids=input_ids), self.field)


def bert():
    """BERT with 4 layers of 256 (4 heads): the encoder of the issue's sweep."""
    import transformers

    config = transformers.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                     intermediate_size=1024)
    return _Hidden(transformers.BertModel(config).eval(), "last_hidden_state"), _tokens(config.vocab_size)


def gpt2():
    """GPT-2 with 4 layers of 256 (4 heads), its language-model head, no cache."""
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, use_cache=False)
    return _Hidden(transformers.GPT2LMHeadModel(config).eval(), "logits"), _tokens(config.vocab_size)


def t5_encoder():
    """T5's encoder at t5-small's sizes (6 layers of 512, 8 heads)."""
    import transformers

    config = transformers.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, use_cache=False)
    return _Hidden(transformers.T5EncoderModel(config).eval(), "last_hidden_state"), _tokens(config.vocab_size)
