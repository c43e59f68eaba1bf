"""`shmcoll-bench` and the library-comparison machinery behind it: an nccl-tests style sweep of one
collective over message sizes, timed and checked the same way for shmcoll, OpenMPI and torch gloo.

One descriptor per collective drives the whole benchmark (collectives.py; the type in
descriptor.py). The modules, from the bottom up:

    inputs.py       sizes, dtypes, ops; exact check inputs and their float64 references
    buffers.py      the buffers a timed loop runs on: one warm buffer or (--cold) many rotating ones
    adapters.py     OpenMPI (mpi4py) and torch gloo joined as groups the descriptors can call
    descriptor.py   the descriptor type: sizing, payload, bus factor, check, each library's calls
    collectives.py  one descriptor per collective, and their registry COLLECTIVES
    results.py      Row (one line of the table) and the JSON files rows go to
    measure.py      warmup, iteration cap, the timed loop and the check: one Row per size
    options.py      the command line and its --help
    peers.py        one rank of a peer's job: python -m shmcoll.bench.peers openmpi|gloo ...
    peer_jobs.py    running the peers' jobs after shmcoll's, and the ratios
    table.py        what rank 0 and the spawning process print
    plot.py         --plot: busbw against size, one line per library
    cli.py          shmcoll-bench itself: spawn with -n, or join a job, sweep, print, write

Nothing here is imported by the library itself.
"""
