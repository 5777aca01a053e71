"""Help texts of the options that several commands share (one wording, one place)."""

# --dtype of every command that runs the engine (the one vocabulary: moekit.calc.dtypes).
ENGINE_DTYPE = "fp32 or bf16 (also spelt float32, bfloat16)."

# The --no-verify option of every command that loads a checkpoint.
NO_VERIFY = ("Skip checking the weights against the crc32s of moekit-experts.json (checked as they load "
             "whenever that file is beside the checkpoint; `moekit checksum` writes it).")

# --weights, on run and serve (moekit.model.int8).
WEIGHTS = ("dtype (the checkpoint's, at --dtype), int8 (every projection's weight int8, one scale per 32 "
           "inputs; activations rounded to int16 per 32 inside the products) or int8-experts (routed experts only).")

# --kernels, on run, serve and bench decode (moekit.ops).
KERNELS = ("auto: moekit's C++ operators where the run uses them (built once per machine, the kernel for each "
           "kind of weight measured once and kept; `moekit ops status` shows both); reference: the plain PyTorch "
           "path only (every product, attention and argmax as torch computes it).")

# --compile/--eager, on run, serve and bench decode (moekit.model.compiled_step).
COMPILE = ("--compile (the default) runs the decode steps as one compiled graph (torch.compile); --eager runs "
           "them eagerly, the reference path (so does --kernels reference without --compile). The first run of a "
           "model on this machine compiles it (minutes) into ~/.cache/moekit/compile/; later runs load it from "
           "there (a line says which, and its time; rm -r that folder to clear it). Models or options it does not "
           "cover run eager, and a note says why.")


def compile_option():
    """The typer default of --compile/--eager: None when neither is given (moekit.model.combinations.
    decode_compiled then decides: compiled, unless --kernels reference)."""
    import typer

    return typer.Option(None, "--compile/--eager", help=COMPILE, show_default=False)


# --expert-parallel, --placement and --ep-timeout, on run and serve (moekit.dist).
EXPERT_PARALLEL = ("Shard the routed experts over N ranks launched here, or over torchrun's ranks with auto "
                   "(see docs/SCALING.md).")
PLACEMENT = "With --expert-parallel: a plan from `moekit placement` (default: experts split evenly, in order)."
EP_TIMEOUT = "With --expert-parallel: seconds a rank waits for the others before failing."


def expert_parallel_options():
    """The three options' typer defaults, (--expert-parallel, --placement, --ep-timeout)."""
    import typer

    return (typer.Option(None, "--expert-parallel", metavar="N|auto", help=EXPERT_PARALLEL),
            typer.Option(None, "--placement", help=PLACEMENT),
            typer.Option(120.0, "--ep-timeout", help=EP_TIMEOUT))
