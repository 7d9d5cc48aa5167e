'''The code of the seed documents (shared/seeds), as their users would run it, and the one change
porting makes: the import lines.

Each snippet keeps the seed's code; what differs, and why, is listed with it:

- ``port`` rewrites ``import deepspeed...`` / ``from deepspeed... import`` /
  ``import transformer_engine...`` / ``from transformer_engine... import`` to the same names under
  ``tachyon.compat``. Nothing else in the code changes (tests/compat/test_seed_snippets.py checks
  that every changed line is an import line).
- Sizes: cells that only set sizes are replaced by CPU-sized ones (``SIZES``), the rest runs as
  written.
- The Transformer Engine tutorial's text in the seed lost its indentation in extraction; the code
  below is the tutorial's code with its indentation restored, token for token otherwise.
- The transformer-kernel tutorial's snippet is a fragment of a model's ``__init__``: it refers to
  ``self``, ``nn`` and ``copy`` and calls the config ``cuda_config`` in its second statement (a
  typo for ``config`` in the tutorial); it runs inside a model class, with that name fixed.
- ``.cuda()`` calls run as no-ops when there is no GPU (the test patches them), so the text stays.
'''

from __future__ import annotations

import dataclasses
import re

_PORTS = (
    (re.compile(r"^(\s*)import deepspeed\s*$"), r"\1import tachyon.compat.deepspeed as deepspeed"),
    (re.compile(r"^(\s*)import deepspeed\.([\w.]+) as (\w+)\s*$"), r"\1import tachyon.compat.deepspeed.\2 as \3"),
    (re.compile(r"^(\s*)from deepspeed(\.[\w.]+)? import (.+)$"), r"\1from tachyon.compat.deepspeed\2 import \3"),
    (re.compile(r"^(\s*)import transformer_engine\.([\w.]+) as (\w+)\s*$"),
     r"\1import tachyon.compat.transformer_engine.\2 as \3"),
    (re.compile(r"^(\s*)from transformer_engine\.([\w.]+) import (.+)$"),
     r"\1from tachyon.compat.transformer_engine.\2 import \3"),
)


def port(code: str) -> str:
    """``code`` with its DeepSpeed / Transformer Engine imports pointed at tachyon.compat."""
    lines = []
    for line in code.splitlines():
        for pattern, replacement in _PORTS:
            if pattern.match(line):
                line = pattern.sub(replacement, line)
                break
        lines.append(line)
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Snippet:
    name: str
    seed: str
    """Which seed document and section it comes from."""
    code: str
    requires: tuple[str, ...] = ()
    """tachyon modules the snippet needs; until they exist the test checks the clear error instead."""


# ---------------------------------------------------------------------- 000: transformer kernel tutorial
KERNEL_TUTORIAL = Snippet(
    "transformer-kernel-tutorial",
    "000 DeepSpeed Transformer Kernel tutorial, 'Integrate Transformer Kernel'",
    """from deepspeed import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
config = DeepSpeedTransformerConfig(batch_size = 64,
                                    max_seq_length = 128,
                                    hidden_size = 1024,
                                    heads = 16,
                                    attn_dropout_ratio = 0.1,
                                    hidden_dropout_ratio = 0.1,
                                    num_hidden_layers = 24,
                                    initializer_range = 0.02,
                                    local_rank = 0,
                                    seed = 1234,
                                    fp16 = True,
                                    pre_layer_norm=True,
                                    attn_dropout_checkpoint=False,
                                    normalize_invertible=False,
                                    gelu_checkpoint=False)
self.layer = nn.ModuleList([
    copy.deepcopy(DeepSpeedTransformerLayer(cuda_config))
    for _ in range(config.num_hidden_layers)
])
""",
)
KERNEL_TUTORIAL_SIZES = {"batch_size = 64": "batch_size = 2", "max_seq_length = 128": "max_seq_length = 16",
                         "hidden_size = 1024": "hidden_size = 64", "heads = 16": "heads = 4",
                         "num_hidden_layers = 24": "num_hidden_layers = 2",
                         "DeepSpeedTransformerLayer(cuda_config)": "DeepSpeedTransformerLayer(config)"}

# ---------------------------------------------------------------------- 001: kernel API reference
KERNEL_API = Snippet(
    "transformer-kernel-api",
    "001 Transformer Kernels API: DeepSpeedTransformerConfig (every parameter) and DeepSpeedTransformerLayer",
    """import deepspeed
config = deepspeed.DeepSpeedTransformerConfig(batch_size=2, hidden_size=64, intermediate_size=256, heads=4,
                                              attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1,
                                              num_hidden_layers=2, initializer_range=0.02, layer_norm_eps=1e-12,
                                              local_rank=-1, seed=7, fp16=False, pre_layer_norm=True,
                                              normalize_invertible=False, gelu_checkpoint=False,
                                              adjust_init_range=True, attn_dropout_checkpoint=False,
                                              stochastic_mode=False, return_tuple=False, training=True)
first = deepspeed.DeepSpeedTransformerLayer(config)
second = deepspeed.DeepSpeedTransformerLayer(config, initial_weights=initial_weights,
                                             initial_biases=initial_biases)
""",
)

# ---------------------------------------------------------------------- 002: TE getting started
TE_SIZES_ORIGINAL = """# Layer configuration
hidden_size = 4096
sequence_length = 2048
batch_size = 4
ffn_hidden_size = 16384
num_attention_heads = 32
dtype = torch.float16

# Synthetic data
x = torch.rand(sequence_length, batch_size, hidden_size).cuda().to(dtype=dtype)
dy = torch.rand(sequence_length, batch_size, hidden_size).cuda().to(dtype=dtype)
"""
TE_SIZES_CPU = """# Layer configuration
hidden_size = 32
sequence_length = 16
batch_size = 2
ffn_hidden_size = 128
num_attention_heads = 2
dtype = torch.float16

# Synthetic data
x = torch.rand(sequence_length, batch_size, hidden_size).cuda().to(dtype=dtype)
dy = torch.rand(sequence_length, batch_size, hidden_size).cuda().to(dtype=dtype)
"""

TE_CELLS = {
    "[1] basic layer": """import torch
import quickstart_utils as utils

class BasicTransformerLayer(torch.nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        layernorm_eps: int = 1e-5,
        attention_dropout: float = 0.1,
        hidden_dropout: float = 0.1,
    ):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln1 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.qkv_projection = torch.nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.attention = utils.DotProductAttention(
            num_attention_heads=num_attention_heads,
            kv_channels=self.kv_channels,
            attention_dropout=attention_dropout,
        )
        self.projection = torch.nn.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln2 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = utils.BasicMLP(
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
        )

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor
    ) -> torch.Tensor:
        res = x
        x = self.ln1(x)

        # Fused QKV projection
        qkv = self.qkv_projection(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)

        x = self.attention(q, k, v, attention_mask)
        x = self.projection(x)
        x = self.dropout(x)
        x = res + x
        res = x
        x = self.ln2(x)
        x = self.mlp(x)

        return x + res
""",
    "[2] configuration": TE_SIZES_ORIGINAL,
    "[3]-[5] basic layer run": """basic_transformer = BasicTransformerLayer(
    hidden_size,
    ffn_hidden_size,
    num_attention_heads,
)
basic_transformer.to(dtype=dtype).cuda()
torch.manual_seed(1234)
y = basic_transformer(x, attention_mask=None)
utils.speedometer(
    basic_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
)
""",
    "[6]-[10] te.Linear and te.LayerNorm": """import transformer_engine.pytorch as te

class BasicTEMLP(torch.nn.Module):
    def __init__(self,
                 hidden_size: int,
                 ffn_hidden_size: int) -> None:
        super().__init__()
        self.linear1 = te.Linear(hidden_size, ffn_hidden_size, bias=True)
        self.linear2 = te.Linear(ffn_hidden_size, hidden_size, bias=True)

    def forward(self, x):
        x = self.linear1(x)
        x = torch.nn.functional.gelu(x, approximate='tanh')
        x = self.linear2(x)
        return x

class BasicTETransformerLayer(torch.nn.Module):
    def __init__(self,
                 hidden_size: int,
                 ffn_hidden_size: int,
                 num_attention_heads: int,
                 layernorm_eps: int = 1e-5,
                 attention_dropout: float = 0.1,
                 hidden_dropout: float = 0.1):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln1 = te.LayerNorm(hidden_size, eps=layernorm_eps)
        self.qkv_projection = te.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.attention = utils.DotProductAttention(
            num_attention_heads=num_attention_heads,
            kv_channels=self.kv_channels,
            attention_dropout=attention_dropout,
        )
        self.projection = te.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln2 = te.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = BasicTEMLP(
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
        )

    def forward(self,
                x: torch.Tensor,
                attention_mask: torch.Tensor):
        res = x
        x = self.ln1(x)

        # Fused QKV projection
        qkv = self.qkv_projection(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)

        x = self.attention(q, k, v, attention_mask)

        x = self.projection(x)
        x = self.dropout(x)
        x = res + x
        res = x
        x = self.ln2(x)
        x = self.mlp(x)

        return x + res

basic_te_transformer = BasicTETransformerLayer(
    hidden_size,
    ffn_hidden_size,
    num_attention_heads,
)
basic_te_transformer.to(dtype=dtype).cuda()
utils.share_parameters_with_basic_te_model(basic_te_transformer, basic_transformer)
torch.manual_seed(1234)
y = basic_te_transformer(x, attention_mask=None)
utils.speedometer(
    basic_te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
)
""",
    "[11]-[14] fused modules": """class FusedTETransformerLayer(torch.nn.Module):
    def __init__(self,
                 hidden_size: int,
                 ffn_hidden_size: int,
                 num_attention_heads: int,
                 layernorm_eps: int = 1e-5,
                 attention_dropout: float = 0.1,
                 hidden_dropout: float = 0.1):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln_qkv = te.LayerNormLinear(hidden_size, 3 * hidden_size, eps=layernorm_eps, bias=True)
        self.attention = utils.DotProductAttention(
            num_attention_heads=num_attention_heads,
            kv_channels=self.kv_channels,
            attention_dropout=attention_dropout,
        )
        self.projection = te.Linear(hidden_size, hidden_size, bias=True)
        self.dropout = torch.nn.Dropout(hidden_dropout)
        self.ln_mlp = te.LayerNormMLP(hidden_size, ffn_hidden_size, eps=layernorm_eps, bias=True)


    def forward(self,
                x: torch.Tensor,
                attention_mask: torch.Tensor):
        res = x
        qkv = self.ln_qkv(x)

        # Split qkv into query, key and value
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)

        x = self.attention(q, k, v, attention_mask)
        x = self.projection(x)
        x = self.dropout(x)
        x = res + x
        res = x
        x = self.ln_mlp(x)

        return x + res

fused_te_transformer = FusedTETransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
fused_te_transformer.to(dtype=dtype).cuda()
utils.share_parameters_with_fused_te_model(fused_te_transformer, basic_transformer)
torch.manual_seed(1234)
y = fused_te_transformer(x, attention_mask=None)
utils.speedometer(
    fused_te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
)
""",
    "[15]-[17] te.TransformerLayer": """te_transformer = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
te_transformer.to(dtype=dtype).cuda()
utils.share_parameters_with_transformerlayer_te_model(te_transformer, basic_transformer)
torch.manual_seed(1234)
y = te_transformer(x, attention_mask=None)
utils.speedometer(
    te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
)
""",
    "[18]-[19] FP8": """from transformer_engine.common.recipe import Format, DelayedScaling

te_transformer = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
te_transformer.to(dtype=dtype).cuda()
utils.share_parameters_with_transformerlayer_te_model(te_transformer, basic_transformer)

fp8_format = Format.HYBRID
fp8_recipe = DelayedScaling(fp8_format=fp8_format, amax_history_len=16, amax_compute_algo="max")
torch.manual_seed(1234)
with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
    y = te_transformer(x, attention_mask=None)
utils.speedometer(
    te_transformer,
    x,
    dy,
    forward_kwargs = { "attention_mask": None },
    fp8_autocast_kwargs = { "enabled": True, "fp8_recipe": fp8_recipe },
)
""",
}
TE_TUTORIAL = Snippet("te-getting-started", "002 Transformer Engine 'Getting Started', cells [1]-[19]",
                      "\n".join(TE_CELLS.values()))

# ---------------------------------------------------------------------- 003: training-engine guide
GUIDE_MODEL = Snippet(
    "training-guide-activation-checkpointing",
    "003 DeepSpeed training guide, 'Using Activation Checkpointing' (BertEncoder; the elided "
    "checkpointed_forward as DeepSpeed's BERT example writes it)",
    """import math
from deepspeed.runtime.activation_checkpointing import checkpointing

class BertEncoder(nn.Module):
    def __init__(self, config):
        super(BertEncoder, self).__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.output_all_encoded_layers = config.output_all_encoded_layers
        self._checkpoint_activations = False
        self._checkpoint_activations_interval = 1

    def checkpointed_forward(self, hidden_states, layer_norm_input, attention_mask, interval):
        def custom(start, end):
            def custom_forward(*inputs):
                x_, ln_ = inputs[0], inputs[1]
                for layer in self.layer[start:end]:
                    x_, ln_ = layer(x_, ln_, inputs[2])
                return x_, ln_
            return custom_forward
        l = 0
        while l < len(self.layer):
            hidden_states, layer_norm_input = checkpointing.checkpoint(
                custom(l, l + interval), hidden_states, layer_norm_input, attention_mask)
            l += interval
        return hidden_states, layer_norm_input

    def forward(self, hidden_states, attention_mask):
        all_encoder_layers = []
        layer_norm_input = 0
        if self._checkpoint_activations:
            hidden_states, layer_norm_input = self.checkpointed_forward(
                hidden_states, layer_norm_input, attention_mask, self._checkpoint_activations_interval)
        else:
            for i, layer_module in enumerate(self.layer):
                hidden_states, layer_norm_input = layer_module(hidden_states, layer_norm_input, attention_mask)
        return hidden_states
""",
)
GUIDE_LOOP = Snippet(
    "training-guide-loop",
    "003 DeepSpeed training guide, 'DeepSpeed Requirements' (add_config_arguments, init_distributed, "
    "initialize, model_engine.backward / step) with its config keys (bf16, ZeRO-1/2, "
    "activation_checkpointing)",
    """import deepspeed
parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
cmd_args = parser.parse_args(argv)
deepspeed.init_distributed(dist_backend=dist_backend)
deepspeed.checkpointing.configure(None, deepspeed_config=cmd_args.deepspeed_config)
model_engine, optimizer, _, _ = deepspeed.initialize(args=cmd_args, model=model,
                                                     model_parameters=model.parameters())
for step, batch in enumerate(data_loader):
    loss = model_engine(batch)
    model_engine.backward(loss)
    model_engine.step()
""",
)
GUIDE_HCCL = Snippet(
    "training-guide-hccl",
    "003 DeepSpeed training guide: deepspeed.init_distributed(dist_backend='hccl', ...)",
    """import deepspeed
deepspeed.init_distributed(dist_backend='hccl', init_method = init_method)
""",
)

# ---------------------------------------------------------------------- 004: overview
OVERVIEW_INFERENCE = Snippet(
    "overview-init-inference",
    "004 DeepSpeed overview, Figure 5 (init_inference with an injection policy; mp_size 1, no mpu, no "
    "checkpoint list on one CPU process)",
    """import deepspeed
import deepspeed.module_inject as module_inject

injection_policy={original_layer_implementation:
                    module_inject.replace_policy.HFGPT2LayerPolicy}
model = deepspeed.init_inference(model,
                                 mp_size=parallel_degree,
                                 mpu=mpu,
                                 checkpoint=checkpoint_list,
                                 dtype=args.dtype,
                                 injection_policy=injection_policy,
                                )
""",
    requires=("tachyon.inference",),
)

SNIPPETS = (KERNEL_TUTORIAL, KERNEL_API, TE_TUTORIAL, GUIDE_MODEL, GUIDE_LOOP, GUIDE_HCCL, OVERVIEW_INFERENCE)
