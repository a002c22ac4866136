"""`python -m serving.api`: the OpenAI-compatible server over one aggregated engine.

    python -m serving.api --model tiny --port 8000        # built-in small model, CPU is fine
    python -m serving.api /ckpt/Qwen3.5-0.8B --served-model-name qwen

Flags follow `vllm serve` where it has one. Every program is compiled at
start-up over the step buckets, so start-up time grows with their number; on
a CPU the unset limits default to small values (8 sequences, 64-token steps,
1024-token context, three programs) to keep start-up near half a minute, and a
second start reads the programs back from the compilation cache.
"""

from serving.flags import server_parser


def main(argv=None) -> None:
    args = server_parser("python -m serving.api", __doc__).parse_args(argv)  # before JAX loads
    from serving.api.server import main as serve

    serve(args)


if __name__ == "__main__":
    main()
