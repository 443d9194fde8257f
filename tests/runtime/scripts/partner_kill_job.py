"""Rank 1 dies (SIGKILL) while rank 0 streams copies to it; rank 0 must live on and say so.

``python partner_kill_job.py OUT [link|mpi]``, two ranks under ``srun --mpi=pmix``:
``link`` sends through :class:`coci_hpc.runtime.partner.PartnerLink`, ``mpi`` through plain
``Isend`` on a duplicate of the world (what the link did before 2026-11-29, kept to show why it
changed: Open MPI 4.1 aborts rank 0 in most runs). Rank 0 writes ``OUT`` (JSON) when it got out
of the loop alive: the messages sent and completed, and the link's ``broken`` reason."""
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from coci_hpc.runtime.partner import PartnerLink

out_path, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "link")
world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
comm = world.Dup()
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank = comm.Get_rank()
link = PartnerLink(comm, 1, 77) if mode == "link" else None
size = 60_000                       # as many as the socket takes: the stream is mid-write when rank 1 dies
buf = np.ones(size, dtype=np.uint8)
world.Barrier()
t0 = time.monotonic()
if rank == 1:
    got = np.empty(size, dtype=np.uint8)
    n = 0
    while time.monotonic() - t0 < 1.5:      # take some in, slowly: unread bytes wait in its socket
        if link is not None:
            if link.arrived() is not None:
                link.recv(got)
                n += 1
        elif comm.Iprobe(source=0, tag=77):
            comm.Recv([got, MPI.BYTE], source=0, tag=77)
            n += 1
        time.sleep(0.002)
    print(f"rank 1 took {n} messages, now SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
reqs: list = []
sent = done = 0
last = time.monotonic()
while time.monotonic() - last < 5.0:          # nothing completed for 5 s: the peer is gone
    if len(reqs) < 64:
        reqs.append(link.isend(link.spec(buf)) if link is not None else comm.Isend([buf, MPI.BYTE], 1, 77))
        sent += 1
    still = [r for r in reqs if not r.Test()]
    if len(still) < len(reqs):
        done += len(reqs) - len(still)
        last = time.monotonic()
    reqs = still
    if link is not None and link.broken is not None:
        break
    time.sleep(0.001)
with open(out_path, "w") as f:
    json.dump({"sent": sent, "done": done, "broken": None if link is None else link.broken,
               "after_s": round(time.monotonic() - t0, 2)}, f)
print(f"rank 0 alive: sent {sent}, done {done}, broken {link.broken if link else None}", flush=True)
os._exit(0)     # not MPI_Finalize: it would wait for the dead rank
