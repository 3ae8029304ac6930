"""A draft replica in its own process, for tests that freeze (SIGSTOP) or kill it: the draft of
`random_pair(vocab=96, seed=9)` behind the internal gRPC server. Prints its port, serves until stdin closes."""
import sys

import torch

from evospec.engine.draft import DraftEngine
from evospec.services.draft.server import DraftServer
from evospec.services.draft.servicer import start_draft_server
from evospec.testing import random_pair
from evospec.vocab.registry import VocabPolicies

if __name__ == "__main__":
    torch.set_num_threads(1)
    vocab = 96
    _, draft = random_pair(vocab=vocab, seed=9, eos=1)
    server = DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, torch.arange(0, vocab, 3)), "sha")
    grpc_server, port = start_draft_server(server, "127.0.0.1")
    print(port, flush=True)
    sys.stdin.read()
    grpc_server.stop(grace=None)
