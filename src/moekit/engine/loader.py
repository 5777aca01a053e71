"""Load a checkpoint folder into a ready engine: spec, weights, tokenizer, stop tokens.

`moekit.load(path)` lands here. The folder is a Hugging Face checkpoint (config.json +
safetensors); tokenizer.json is optional (without it the engine works on token ids), and the
stop tokens come from config.json and generation_config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from moekit import ops
from moekit.calc.dtypes import engine_dtype
from moekit.engine.generate import Generation, TokenCallback, generate
from moekit.engine.meter import TokenActivation, dense_saving_bytes, meter, packed_expert_bytes
from moekit.engine.sampling import SamplingParams
from moekit.errors import CheckpointError, MoekitError
from moekit.model.combinations import CPU_ONLY, Options, check, decode_compiled
from moekit.spec.model_spec import ModelSpec

WEIGHTS = ("dtype", "int8", "int8-experts")  # the checkpoint's weights at dtype, or int8 (moekit.model.int8)

Prompt = Union[str, Sequence[int]]


@dataclass
class Engine:
    """A loaded model. `generate` takes text (needs a tokenizer) or token ids, one prompt or many."""

    spec: ModelSpec
    decoder: object  # moekit.model.decoder.Decoder
    tokenizer: Optional[object]  # tokenizers.Tokenizer, None when the folder has no tokenizer.json
    eos_ids: tuple[int, ...]
    dtype: str
    device: str
    folder: Path
    store: Optional[object] = None  # moekit.offload.store.ExpertStore when experts are paged
    notes: tuple[str, ...] = ()  # what loading decided that the user should hear
    weights: str = "dtype"  # one of WEIGHTS
    expert_bytes: Optional[Callable[[int, int], int]] = None  # (layer, expert) → its bytes; None: the dtype's
    dense_saving: int = 0  # bytes the int8 projections outside the experts hold less (meter.dense_saving_bytes)

    def close(self) -> None:
        """Stop the expert store's reader threads (a no-op for a resident model)."""
        if self.store is not None:
            self.store.close()

    @property
    def bytes_per_param(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise MoekitError(f"{self.folder}: no tokenizer.json, so a text prompt cannot be encoded; give token ids")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise MoekitError(f"{self.folder}: no tokenizer.json, so ids cannot be decoded to text")
        return self.tokenizer.decode(list(ids))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        max_new_tokens: int = 64,
        sampling: SamplingParams = SamplingParams(),
        stop_ids: Optional[Sequence[int]] = None,
        on_token: Optional[TokenCallback] = None,
        record_routing: bool = True,
        policy=None,
    ) -> Generation:
        """stop_ids None means the model's eos tokens; () means never stop early. policy: a
        moekit.model.routing policy (parse_policy), None for the family's routing."""
        batch = _as_batch(prompts)
        return generate(
            self.decoder,
            [self.prompt_ids(p) for p in batch],
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_ids=self.eos_ids if stop_ids is None else tuple(stop_ids),
            on_token=on_token,
            record_routing=record_routing,
            policy=policy,
        )

    def meter(self, gen: Generation) -> list[TokenActivation]:
        return meter(self.spec, gen, self.bytes_per_param, expert_bytes=self.expert_bytes,
                     dense_saving=self.dense_saving)


def _as_batch(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of ids
    return prompts


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value if v is not None)


def eos_ids(folder: Path, config: dict, spec: ModelSpec) -> tuple[int, ...]:
    """Stop tokens: the spec's, config.json's and generation_config.json's, in that order, no repeats."""
    found = list(spec.eos_token_ids) + list(_ids(config.get("eos_token_id")))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        try:
            found += _ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, TypeError, ValueError):
            raise CheckpointError(f"{gen_path}: not valid JSON") from None
    return tuple(dict.fromkeys(found))


def load_tokenizer(folder: Path):
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on a bad file
        raise CheckpointError(f"{path}: cannot read tokenizer ({err})") from None


def resolve_device(device: str):
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise MoekitError(f"unknown device {device!r} (use cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MoekitError("device cuda requested but no CUDA GPU is available")
    if dev.type not in ("cpu", "cuda"):
        raise MoekitError(f"device {device!r} is not supported (use cpu or cuda)")
    return dev


def torch_dtype(dtype: str):
    import torch

    return getattr(torch, engine_dtype(dtype, "dtype"))


def load_engine(
    path: Union[str, Path], dtype: str = "float32", device: str = "cpu", offload=None, progress=None,
    weights: str = "dtype", verify: bool = True, compile: Optional[bool] = None, kernels: str = "auto",
) -> Engine:
    """offload: a moekit.offload.options.OffloadOptions to page routed experts under a byte budget
    (None: every weight resident). progress(done, total) reports a first-run checksum manifest.
    weights: "dtype" (the checkpoint's, at dtype), "int8" (every projection's weight int8, one
    scale per 32 inputs, quantized once here; activations rounded to int16 per 32 in the products) or "int8-experts" (the routed experts only).
    verify: check every weight read against moekit-experts.json when one is beside the checkpoint
    (moekit.weights.checkpoint; the resident load never writes one); False skips it, said in notes.
    A first paged run writes the manifest even then: it is the store's map of where experts are.
    compile: None (the default) runs the decode steps as one compiled graph (moekit.model.compiled_step),
    except with kernels="reference" (the reference path is eager); True compiles them whatever
    `kernels`; False runs them eagerly. Where this model or these options cannot compile, the engine
    runs eager and one note says why.
    kernels: "auto" loads moekit's C++ operators where this run uses them (`operators_used`; built
    once per machine, a failed build one line in notes naming its log, the reference then running)
    and prepares the decoder for them (an eager step's fp32 / bf16 products run them too),
    "reference" never loads them: every product, attention and argmax the plain PyTorch way."""
    from moekit.model.decoder import Decoder
    from moekit.weights.gguf_spec import load_any_spec
    from moekit.weights.checkpoint import base_checkpoint, open_checkpoint
    from moekit.weights.quantized import quant_method

    folder = Path(path)
    dtype = engine_dtype(dtype, "dtype")  # any spelling of the vocabulary; the engine keeps torch's name
    tdtype = torch_dtype(dtype)
    if weights not in WEIGHTS:
        raise MoekitError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    dev = resolve_device(device)
    compile = decode_compiled(compile, kernels)
    check(Options(compile=compile, paged=offload is not None, weights=weights, device=dev.type))  # before any weight loads
    ckpt = open_checkpoint(folder)
    spec = load_any_spec(folder)
    plan, notes = None, []
    if compile and dev.type != "cpu":  # known before loading: lay the weights out for the eager kernels
        notes.append(f"decode steps run eager: {CPU_ONLY}")
        compile = False
    # A GGUF's paged experts stay in their blocks (Q8_0 / Q4_0): the store runs them on the operators,
    # at any dtype (without them each use dequantized a whole expert: 30B's decode was that slow).
    packed = quant_method(ckpt.config, folder) is not None or (folder.suffix == ".gguf" and offload is not None)
    operators, kernel_notes = load_kernels(kernels, ops.operators_used(compile, weights, dtype, offload is not None, packed=packed))
    notes.extend(kernel_notes)
    gguf_tokenizer = gguf_manifest = None
    if folder.suffix == ".gguf":  # a GGUF file (moekit.weights.gguf_checkpoint): its tokenizer, what was dequantized,
        from moekit.weights.gguf_checkpoint import engine_parts  # where the store finds its experts

        gguf_tokenizer, gguf_manifest, gguf_notes = engine_parts(ckpt, offload, verify)
        notes.extend(gguf_notes)
    checked = base_checkpoint(ckpt)  # the safetensors reads verification happens in
    if checked is not None:
        checked.verify = verify
    if not verify:
        notes.append("checksums not verified (--no-verify)")
    if offload is None and _packed_in_blocks(folder):
        from moekit.offload.options import OffloadOptions

        # A resident load would run the checkpoint's float experts, not the packed int8/int4 ones.
        offload = OffloadOptions(expert_memory="100%")
        notes.append("packed int8/int4 experts and no --expert-memory: every expert is loaded resident (the store "
                     "holds them all, no paging); --expert-memory sets a budget")
    if offload is not None:
        from moekit.offload.attach import plan_offload

        plan = plan_offload(spec, tdtype, offload, folder=folder, quantize=weights != "dtype", manifest=gguf_manifest)
        if plan.fully_resident:
            notes.append(f"--expert-memory {offload.expert_memory} holds every routed expert: running fully resident")
            plan = None
    decoder = Decoder(spec, dtype=tdtype, device=dev, offload_experts=plan is not None)
    # --weights int8: each projection is quantized as it is read, so the load never holds the
    # dense weights whole at the dtype (quantize_decoder below then does the routed experts).
    decoder.load_checkpoint(ckpt, kernels=not compile, operators=operators, int8=weights == "int8")
    decoder.eval()
    ckpt.close()  # the dense weights are copied: unmap the files so they are not counted twice
    if checked is not None:
        notes.extend(checked.notes)  # (close raised any checksum mismatch)
    if weights != "dtype":
        from moekit.model.int8 import quantize_decoder

        notes.append(quantize_decoder(decoder, experts_only=weights == "int8-experts"))
    if plan is None and dev.type == "cpu":
        from moekit.model.huge_pages import move_to_huge_pages

        move_to_huge_pages(decoder)  # every decode step streams these: 2 MB pages, not 4 KB ones
    store = None
    if plan is not None:
        from moekit.offload.attach import attach_store

        store = attach_store(decoder, folder, plan, offload, progress=progress, quantize=weights != "dtype",
                             verify=verify, manifest=gguf_manifest)
        notes.extend(store.notes)
    if compile:  # after the store: its layers and prefetch guesses are in the step (offload.graph_store)
        notes.append(_compile_decode(decoder))
    return Engine(
        spec=spec,
        decoder=decoder,
        tokenizer=gguf_tokenizer if folder.suffix == ".gguf" else load_tokenizer(folder),
        eos_ids=eos_ids(folder, ckpt.config, spec),
        dtype=dtype,
        device=str(dev),
        folder=folder,
        store=store,
        notes=tuple(notes),
        weights=weights,
        expert_bytes=store.expert_nbytes if store is not None
        else _resident_expert_bytes(spec, weights) or packed_expert_bytes(decoder),  # MXFP4 / FP8 kept packed
        dense_saving=dense_saving_bytes(decoder, tdtype.itemsize),
    )


def load_kernels(kernels: str, used: bool) -> tuple[bool, list[str]]:
    """Load the operators for a run that uses them (--kernels auto) → (whether this command loaded
    them: the decoder is then prepared for them, moekit.model.linear.ROWS; the notes: one line per
    build that failed, naming the compiler's log). (False, []) for --kernels reference."""
    if kernels not in ops.KERNELS:
        raise MoekitError(f"--kernels must be one of {', '.join(ops.KERNELS)}, got {kernels!r}")
    if kernels == "reference" or not used:
        return False, []
    loaded = ops.load()
    return loaded.ok, loaded.failures()


def _compile_decode(decoder) -> str:
    """Install the compiled decode step, or say why the engine stays eager."""
    from moekit.model.compiled_step import unsupported

    reason = unsupported(decoder)
    if reason is not None:
        return f"decode steps run eager: {reason}"
    decoder.compile_decode()
    return "decode steps run as one compiled graph (the first step compiles it; --eager runs the eager reference)"


def _packed_in_blocks(folder: Path) -> bool:
    """Whether `folder` is a packed checkpoint whose experts are (partly) int8/int4 blocks."""
    from moekit.weights.extents import PACKED_NAME

    if not (folder / PACKED_NAME).is_file():
        return False
    from moekit.offload.attach import packed_experts
    from moekit.offload.precision import stored_kind

    packed = packed_experts(folder)
    return packed is not None and any(stored_kind(ex) for ex in packed.values())


def _resident_expert_bytes(spec: ModelSpec, weights: str):
    """(layer, expert) → bytes for the meter when resident experts are int8; None: the dtype's."""
    if weights == "dtype" or not spec.moe_layers:
        return None
    from moekit.offload.attach import expert_shape, int8_nbytes

    each = int8_nbytes(*expert_shape(spec))
    return lambda layer, e: each
