"""The encoder registry: one entry per frozen foundation model, the only place that knows it.

Torch-free on purpose: the Snakefile reads names and resource hints at parse time and the
configuration validates ``model.encoder.name`` against ``ENCODERS``. The runtime side (building,
strict loading, pooling, blocks, LoRA module names) is ``fedhisto.model.encoders``; it reads
everything model-specific from the entry.

Adding an encoder is one entry here plus its row in ``tests/test_zoo.py`` (``docs/encoders.md``).

Parameter counts: ``parameters`` is the exact count of the backbone as this entry builds it (the
tests rebuild it on the meta device and compare); ``published`` is the figure its authors give,
with the source, and ``published_figure`` that figure as stated ("1.1B"); a test checks the exact
count lies within one unit of the figure's last stated digit (figures are rounded, and some are the
architecture class's: Virchow2's "632M" is ViT-H/14's, its SwiGLU MLP at ratio 5.3375 builds 631.2M).

Revisions: a hub revision is pinned only where a commit hash could be verified; every other entry
says so in ``revision_note`` and loading it from the hub needs ``model.encoder.revision`` set (or a
local folder), so no run silently follows a moving ``main``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HIBOU_MEAN = (0.7068, 0.5755, 0.722)  # histai/hibou-b preprocessor_config.json (also hibou-L's)
HIBOU_STD = (0.195, 0.2316, 0.1816)
HOPTIMUS_MEAN = (0.707223, 0.578729, 0.703617)  # bioptimus/H-optimus-0 and -1 model cards
HOPTIMUS_STD = (0.211883, 0.230117, 0.177517)

#: transformers attention projections (q/k/v/o) as the installed release names them.
TRANSFORMERS_LORA = MappingProxyType({
    "query": ("attention.q_proj", "attention.attention.query"),
    "key": ("attention.k_proj", "attention.attention.key"),
    "value": ("attention.v_proj", "attention.attention.value"),
    "attention_output": ("attention.o_proj", "attention.output.dense"),
})
#: timm's fused attention: one ``attn.qkv`` Linear carries query, key and value, ``attn.proj`` the
#: output. The suffix includes ``attn.``: a bare ``proj`` would also hit ``patch_embed.proj``.
TIMM_LORA = MappingProxyType({
    "query": ("attn.qkv",),
    "key": ("attn.qkv",),
    "value": ("attn.qkv",),
    "attention_output": ("attn.proj",),
})


@dataclass(frozen=True)
class Resources:
    """What the train / predict rules ask the scheduler for (``workflow/rules/common.smk``)."""

    train_mem_mb: int
    train_runtime: int  # minutes
    predict_mem_mb: int
    predict_runtime: int  # minutes
    gpu: int


CPU_SMALL = Resources(train_mem_mb=3000, train_runtime=30, predict_mem_mb=2000, predict_runtime=10, gpu=0)
GPU_BASE = Resources(train_mem_mb=24000, train_runtime=720, predict_mem_mb=16000, predict_runtime=60, gpu=1)
GPU_LARGE = Resources(train_mem_mb=32000, train_runtime=1440, predict_mem_mb=24000, predict_runtime=120, gpu=1)
GPU_HUGE = Resources(train_mem_mb=48000, train_runtime=2880, predict_mem_mb=32000, predict_runtime=240, gpu=1)
GPU_GIANT = Resources(train_mem_mb=64000, train_runtime=4320, predict_mem_mb=48000, predict_runtime=360, gpu=1)


@dataclass(frozen=True)
class EncoderEntry:
    name: str
    family: Literal["transformers", "timm"]
    architecture: str  # transformers model class, or timm architecture name
    kwargs: MappingProxyType  # transformers config kwargs, or timm create_model kwargs
    width: int  # token width (hidden size / embed_dim)
    depth: int  # transformer blocks
    patch_size: int
    input_size: int  # the pretraining resolution (pixels per side)
    prefix_tokens: int  # CLS plus register tokens before the patch tokens
    pooling: Literal["cls", "cls+mean_patch"]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    blocks_path: str  # attribute path of the block list (FedStain restyles after block k)
    lora_suffixes: MappingProxyType  # paper name of a LoRA target -> module-name suffixes
    parameters: int  # exact backbone count as built here
    published: str  # the authors' figure and where it is stated
    published_figure: str | None  # that figure as stated, e.g. "1.1B" (None: the tiny encoder has none)
    licence: str
    hub_id: str | None
    revision: str | None
    revision_note: str
    gated: bool
    resources: Resources
    pretrainable: bool = False  # only the tiny encoder is pretrained by the pipeline
    ignore_keys: tuple[str, ...] = ()  # hub checkpoint tensors the entry deliberately does not build
    notes: str = ""
    extra: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    @property
    def dim(self) -> int:
        """Width of the pooled embedding the PEFT head sees."""
        return self.width * (2 if self.pooling == "cls+mean_patch" else 1)

    @property
    def fused_qkv(self) -> bool:
        return self.lora_suffixes["query"] == self.lora_suffixes["key"] == self.lora_suffixes["value"]

    def get_started(self) -> str:
        """How to provide weights, for error messages."""
        where = f"https://huggingface.co/{self.hub_id}" if self.hub_id else "no hub repository"
        gate = (f"{self.hub_id} is gated: accept its terms on {where}, log in (`huggingface-cli login`), "
                "download a snapshot (`huggingface-cli download " f"{self.hub_id} --local-dir DIR`) and set "
                "model.encoder.local_dir: DIR") if self.gated else (
                f"download a snapshot of {where} and set model.encoder.local_dir, or pin model.encoder.revision")
        return gate

    # an entry is immutable data: copies of a model share it, and a pickled entry is its registry name
    def __deepcopy__(self, memo: dict) -> EncoderEntry:
        return self

    def __reduce__(self):
        return encoder_entry, (self.name,)


def _entries(*entries: EncoderEntry) -> MappingProxyType:
    return MappingProxyType({e.name: e for e in entries})


def _kw(**kwargs: Any) -> MappingProxyType:
    return MappingProxyType(kwargs)


_UNPINNED = ("no commit hash of this repository could be verified from the sources this project can "
             "reach; set model.encoder.revision to the commit you downloaded (or use local_dir)")

ENCODERS: MappingProxyType = _entries(
    EncoderEntry(
        name="tiny", family="transformers", architecture="Dinov2WithRegistersModel",
        kwargs=_kw(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, patch_size=8, image_size=48,
                   num_register_tokens=4, use_swiglu_ffn=True, mlp_ratio=4),
        width=64, depth=3, patch_size=8, input_size=48, prefix_tokens=5, pooling="cls",
        mean=IMAGENET_MEAN, std=IMAGENET_STD, blocks_path="encoder.layer", lora_suffixes=TRANSFORMERS_LORA,
        parameters=168_928, published="none: the project's CPU-sized DINOv2-with-registers (HIBOU-B's family)",
        published_figure=None,
        licence="MIT (this project)", hub_id=None, revision=None,
        revision_note="pretrained by the pipeline (stage pretrain) on synthetic tissue only", gated=False,
        resources=CPU_SMALL, pretrainable=True),
    EncoderEntry(
        name="hibou-b", family="transformers", architecture="Dinov2WithRegistersModel",
        kwargs=_kw(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, patch_size=14, image_size=224,
                   num_register_tokens=4, use_swiglu_ffn=True, mlp_ratio=4),
        width=768, depth=12, patch_size=14, input_size=224, prefix_tokens=5, pooling="cls",
        mean=HIBOU_MEAN, std=HIBOU_STD, blocks_path="encoder.layer", lora_suffixes=TRANSFORMERS_LORA,
        parameters=85_741_056,
        published="85.7M: ViT-B/14 (Nechaev et al. 2024, Hibou, arXiv:2406.05074; https://bio.rodeo/models/hibou)",
        published_figure="85.7M",
        licence="Apache-2.0", hub_id="histai/hibou-b", revision="7fdc8cce365ebfd9e7e60e6e9a8d4d59388f3c",
        revision_note=("the study configuration's pin, kept so its run identities stand; it has 38 hex digits, "
                       "not a full 40-digit commit, and could not be checked against the hub from here"),
        gated=False, resources=GPU_BASE,
        notes="the study (section 3.4) normalises with ImageNet statistics, not HIBOU's processor"),
    EncoderEntry(
        name="hibou-l", family="transformers", architecture="Dinov2WithRegistersModel",
        kwargs=_kw(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, patch_size=14, image_size=224,
                   num_register_tokens=4, use_swiglu_ffn=True, mlp_ratio=4),
        width=1024, depth=24, patch_size=14, input_size=224, prefix_tokens=5, pooling="cls",
        mean=HIBOU_MEAN, std=HIBOU_STD, blocks_path="encoder.layer", lora_suffixes=TRANSFORMERS_LORA,
        parameters=303_659_264,
        published="0.3B: ViT-L/14 (Nechaev et al. 2024, Hibou, arXiv:2406.05074; ViT-L as in DINOv2's vit_large)",
        published_figure="0.3B",
        licence="Apache-2.0", hub_id="histai/hibou-L", revision=None, revision_note=_UNPINNED, gated=True,
        resources=GPU_LARGE),
    EncoderEntry(
        name="phikon", family="transformers", architecture="ViTModel",
        kwargs=_kw(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                   patch_size=16, image_size=224, qkv_bias=True, layer_norm_eps=1e-12),
        width=768, depth=12, patch_size=16, input_size=224, prefix_tokens=1, pooling="cls",
        mean=IMAGENET_MEAN, std=IMAGENET_STD, blocks_path="layers", lora_suffixes=TRANSFORMERS_LORA,
        parameters=85_798_656,
        published="86M: ViT-B/16 (Filiot et al. 2023, iBOT for histology, medRxiv 2023.07.21.23292757)",
        published_figure="86M",
        licence="Owkin non-commercial licence (model card)", hub_id="owkin/phikon", revision=None,
        revision_note=_UNPINNED, gated=False, resources=GPU_BASE, ignore_keys=("pooler.",),
        notes="built without ViTModel's Dense+tanh pooler: the model card embeds with last_hidden_state[:, 0]"),
    EncoderEntry(
        name="phikon-v2", family="transformers", architecture="Dinov2Model",
        kwargs=_kw(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, patch_size=16, image_size=224,
                   mlp_ratio=4, layerscale_value=1e-5, use_swiglu_ffn=False),
        width=1024, depth=24, patch_size=16, input_size=224, prefix_tokens=1, pooling="cls",
        mean=IMAGENET_MEAN, std=IMAGENET_STD, blocks_path="encoder.layer", lora_suffixes=TRANSFORMERS_LORA,
        parameters=303_351_808,
        published="0.3B: ViT-L/16 (Filiot et al. 2024, Phikon-v2, arXiv:2409.09173)",
        published_figure="0.3B",
        licence="Owkin non-commercial licence (model card)", hub_id="owkin/phikon-v2", revision=None,
        revision_note=_UNPINNED, gated=False, resources=GPU_LARGE),
    EncoderEntry(
        name="uni", family="timm", architecture="vit_large_patch16_224",
        kwargs=_kw(img_size=224, patch_size=16, init_values=1e-5, num_classes=0, global_pool="",
                   dynamic_img_size=True),
        width=1024, depth=24, patch_size=16, input_size=224, prefix_tokens=1, pooling="cls",
        mean=IMAGENET_MEAN, std=IMAGENET_STD, blocks_path="blocks", lora_suffixes=TIMM_LORA,
        parameters=303_350_784,
        published="303M: ViT-L/16 (Chen et al. 2024, UNI, Nature Medicine 30:850; 303.4M as listed by LazySlide)",
        published_figure="303M",
        licence="CC-BY-NC-ND-4.0", hub_id="MahmoodLab/UNI", revision=None, revision_note=_UNPINNED, gated=True,
        resources=GPU_LARGE),
    EncoderEntry(
        name="uni2-h", family="timm", architecture="vit_giant_patch14_224",
        kwargs=_kw(img_size=224, patch_size=14, depth=24, num_heads=24, init_values=1e-5, embed_dim=1536,
                   mlp_ratio=2.66667 * 2, num_classes=0, no_embed_class=True, mlp_layer="timm.layers.SwiGLUPacked",
                   act_layer="silu", reg_tokens=8, dynamic_img_size=True, global_pool=""),
        width=1536, depth=24, patch_size=14, input_size=224, prefix_tokens=9, pooling="cls",
        mean=IMAGENET_MEAN, std=IMAGENET_STD, blocks_path="blocks", lora_suffixes=TIMM_LORA,
        parameters=681_394_176,
        published="681M: ViT-H/14, 8 registers (MahmoodLab/UNI2-h model card, 2025)",
        published_figure="681M",
        licence="CC-BY-NC-ND-4.0", hub_id="MahmoodLab/UNI2-h", revision=None, revision_note=_UNPINNED, gated=True,
        resources=GPU_HUGE),
    EncoderEntry(
        name="virchow2", family="timm", architecture="vit_huge_patch14_224",
        kwargs=_kw(img_size=224, init_values=1e-5, num_classes=0, reg_tokens=4, mlp_ratio=5.3375, global_pool="",
                   dynamic_img_size=True, mlp_layer="timm.layers.SwiGLUPacked", act_layer="silu"),
        width=1280, depth=32, patch_size=14, input_size=224, prefix_tokens=5, pooling="cls+mean_patch",
        mean=IMAGENET_MEAN, std=IMAGENET_STD, blocks_path="blocks", lora_suffixes=TIMM_LORA,
        parameters=631_239_424,
        published="632M: ViT-H/14, 4 registers (Zimmermann et al. 2024, Virchow2, arXiv:2408.00738)",
        published_figure="632M",
        licence="CC-BY-NC-ND-4.0", hub_id="paige-ai/Virchow2", revision=None, revision_note=_UNPINNED, gated=True,
        resources=GPU_HUGE,
        notes="the model card's embedding: CLS concatenated with the mean of the patch tokens (registers excluded)"),
    EncoderEntry(
        name="h-optimus-0", family="timm", architecture="vit_giant_patch14_reg4_dinov2",
        kwargs=_kw(img_size=224, init_values=1e-5, num_classes=0, global_pool="", dynamic_img_size=True),
        width=1536, depth=40, patch_size=14, input_size=224, prefix_tokens=5, pooling="cls",
        mean=HOPTIMUS_MEAN, std=HOPTIMUS_STD, blocks_path="blocks", lora_suffixes=TIMM_LORA,
        parameters=1_134_774_272,
        published="1.1B: ViT-g/14, 4 registers (bioptimus/H-optimus-0 model card; Saillard et al. 2024)",
        published_figure="1.1B",
        licence="Apache-2.0", hub_id="bioptimus/H-optimus-0", revision=None, revision_note=_UNPINNED, gated=True,
        resources=GPU_GIANT),
    EncoderEntry(
        name="h-optimus-1", family="timm", architecture="vit_giant_patch14_reg4_dinov2",
        kwargs=_kw(img_size=224, init_values=1e-5, num_classes=0, global_pool="", dynamic_img_size=True),
        width=1536, depth=40, patch_size=14, input_size=224, prefix_tokens=5, pooling="cls",
        mean=HOPTIMUS_MEAN, std=HOPTIMUS_STD, blocks_path="blocks", lora_suffixes=TIMM_LORA,
        parameters=1_134_774_272,
        published="1.1B: ViT-g/14, 4 registers (bioptimus/H-optimus-1 model card, 2025)",
        published_figure="1.1B",
        licence="non-commercial terms of the model card (gated)", hub_id="bioptimus/H-optimus-1", revision=None,
        revision_note=_UNPINNED, gated=True, resources=GPU_GIANT),
    EncoderEntry(
        name="prov-gigapath", family="timm", architecture="vit_giant_patch14_dinov2",
        kwargs=_kw(img_size=224, in_chans=3, patch_size=16, embed_dim=1536, depth=40, num_heads=24,
                   mlp_ratio=5.33334, init_values=1e-5, num_classes=0, global_pool="", dynamic_img_size=True),
        width=1536, depth=40, patch_size=16, input_size=224, prefix_tokens=1, pooling="cls",
        mean=IMAGENET_MEAN, std=IMAGENET_STD, blocks_path="blocks", lora_suffixes=TIMM_LORA,
        parameters=1_134_953_984,
        published="1.1B: tile encoder ViT-g/14 at patch 16 (Xu et al. 2024, Prov-GigaPath, Nature 630:181)",
        published_figure="1.1B",
        licence="Apache-2.0", hub_id="prov-gigapath/prov-gigapath", revision=None, revision_note=_UNPINNED,
        gated=True, resources=GPU_GIANT, notes="the tile encoder only (the slide encoder is not a tile embedding)"),
)

ENCODER_NAMES: tuple[str, ...] = tuple(ENCODERS)


def encoder_entry(name: str) -> EncoderEntry:
    """The registry entry; an unknown name lists the known ones."""
    try:
        return ENCODERS[name]
    except KeyError:
        raise KeyError(f"unknown encoder {name!r}; known encoders: {', '.join(ENCODER_NAMES)}") from None
