"""`python -m moekit.dist.worker`: one rank of a self-launched expert-parallel run (see session.launch).

Reads {"job", "rank", "world", "port"} as JSON on stdin (with "serve": true, a follower of
`moekit serve --expert-parallel`, and its "threads"), joins the launcher's TCPStore, runs its
part quietly. A MoekitError is one line on stderr, naming the rank, and exit 2, as the CLI does.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    from moekit.dist.group import Rank, threads_per_rank
    from moekit.dist.session import Job, run_rank
    from moekit.errors import MoekitError

    order = json.loads(sys.stdin.read())
    me = Rank(rank=int(order["rank"]), world=int(order["world"]), store_port=int(order["port"]))
    try:
        import torch

        torch.set_num_threads(order.get("threads") or threads_per_rank(me.world))
        if order.get("serve"):
            import signal

            from moekit.dist.serving import follower

            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 drains, then stops us
            follower(Job(**order["job"]), me)
        else:
            run_rank(Job(**order["job"]), me)
    except MoekitError as err:
        text = str(err)
        print(f"error: {text if text.startswith('rank ') else f'rank {me.rank}: {text}'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
