"""The published architectures: each one's text config as released. `tools/make_target.py` builds
targets from them; `pipeline plan` (pipeline/target/parameter_count.py) sizes a run from them.

Only numbers come from the releases (their `config.json`'s `text_config`, Hugging Face field
names); each entry says where. Left out on purpose: the token ids (`eos_token_id`, `pad_token_id`,
`bos_token_id`: the built target's tokenizer sets them, see make_target.py), the MTP head's fields
(`mtp_num_hidden_layers`, ...: no MTP weights are built) and the vision tower (the text-only causal
LM is what extraction loads). `full_attention_interval` is not a transformers field: it gives
`layer_types` (layer i is full attention when (i + 1) % interval == 0, three Gated DeltaNet layers
then one full-attention layer), as transformers' config does when a release omits `layer_types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Shared by every Qwen3.5/3.6 text tower below (each source lists them): partial RoPE over a quarter
# of the 256-wide head with the interleaved multimodal sections, rope_theta 1e7, 256k positions.
_QWEN35_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
_QWEN35_COMMON = {
    "vocab_size": 248_320,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "max_position_embeddings": 262_144,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "attention_bias": False,
    "attn_output_gate": True,
    "tie_word_embeddings": False,
    "rope_parameters": _QWEN35_ROPE,
}


@dataclass(frozen=True)
class Arch:
    """One published text architecture: its name here, its text config, where the numbers come from."""

    name: str
    config: dict = field(repr=False)
    source: str = ""

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def full_layers(self) -> int:
        return self.config["num_hidden_layers"]

    def layer_types(self, layers: int) -> list[str]:
        """The first `layers` of the published pattern: reduced depth keeps the hybrid order."""
        every = self.config.get("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]

    def text_config(self, layers: int) -> dict:
        """The config's fields at `layers` decoder layers (Hugging Face names, no token ids)."""
        fields = {k: v for k, v in self.config.items() if k != "full_attention_interval"}
        return {**fields, "num_hidden_layers": layers, "layer_types": self.layer_types(layers)}


ARCHS = {
    a.name: a
    for a in (
        # Qwen/Qwen3.6-27B config.json (revision 6a9e13bd6fc8f0983b9b99948120bc37f49c13e9), text_config;
        # the same shapes as Qwen3.5-27B (THUDM/slime scripts/models/qwen3.5-27B.sh: 64 layers, hidden
        # 5120, ffn 17408, 24 heads / 4 query groups of 256, rotary 0.25, base 1e7, vocab 248320).
        Arch(
            "qwen3.6-27b",
            {
                "model_type": "qwen3_5_text",
                **_QWEN35_COMMON,
                "num_hidden_layers": 64,
                "hidden_size": 5120,
                "intermediate_size": 17408,
                "num_attention_heads": 24,
                "num_key_value_heads": 4,
                "linear_num_value_heads": 48,
            },
            "Qwen/Qwen3.6-27B config.json, text_config",
        ),
        # Qwen/Qwen3.5-9B config.json, text_config (as quoted in public test fixtures of it); also
        # transformers' own Qwen3_5TextConfig defaults: 32 layers, hidden 4096, ffn 12288, 16 heads /
        # 4 KV heads of 256, Gated DeltaNet 16 key / 32 value heads of 128.
        Arch(
            "qwen3.5-9b",
            {
                "model_type": "qwen3_5_text",
                **_QWEN35_COMMON,
                "num_hidden_layers": 32,
                "hidden_size": 4096,
                "intermediate_size": 12288,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "linear_num_value_heads": 32,
            },
            "Qwen/Qwen3.5-9B config.json, text_config",
        ),
        # Qwen/Qwen3.5-35B-A3B config.json (revision 59d61f3ce65a6d9863b86d2e96597125219dc754),
        # text_config; transformers' Qwen3_5MoeTextConfig defaults are documented against the same
        # checkpoint: 40 layers, hidden 2048, 16 heads / 2 KV heads of 256, 256 experts of 512 with
        # 8 routed a token, one shared expert of 512, Gated DeltaNet 16 key / 32 value heads of 128.
        Arch(
            "qwen3.5-35b-a3b",
            {
                "model_type": "qwen3_5_moe_text",
                **_QWEN35_COMMON,
                "num_hidden_layers": 40,
                "hidden_size": 2048,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "linear_num_value_heads": 32,
                "num_experts": 256,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
                "router_aux_loss_coef": 0.001,
                "output_router_logits": False,
            },
            "Qwen/Qwen3.5-35B-A3B config.json, text_config",
        ),
    )
}
