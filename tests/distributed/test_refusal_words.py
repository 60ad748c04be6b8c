"""The words a rank says beside its call in an agreement (a refusal's own error): named in
the others' PeerMismatchError beside that rank's call, never compared (ranks whose calls
are alike agree whatever their words)."""
from __future__ import annotations

from gpukv.distributed.mpi import agree


class _Ranks:
    """The one thing `_difference` asks of a transport: ranks named for a message."""

    @staticmethod
    def ranks(ranks) -> str:
        return ", ".join(map(str, ranks))


PUSH = ("push assigning the sum", (1, 2, 3))
REFUSED = ("push refused (ShapeError)", ())


def test_a_refusals_words_are_said_beside_its_call():
    calls = {0: (4, PUSH, None),
             1: (4, REFUSED, "key 3: push expects shape (4,), got (5,)"),
             2: (4, PUSH, None)}
    assert agree._told(_Ranks(), calls) == (
        "rank(s) 0, 2 calls push assigning the sum of key 1, key 2, key 3; rank(s) 1 calls "
        "push refused (ShapeError): key 3: push expects shape (4,), got (5,)")


def test_ranks_refusing_in_words_of_their_own_are_named_each_with_its_own():
    calls = {0: (2, PUSH, None), 1: (2, REFUSED, "got (5,)"), 2: (2, REFUSED, "got (6,)")}
    assert agree._told(_Ranks(), calls) == (
        "rank(s) 0 calls push assigning the sum of key 1, key 2, key 3; rank(s) 1 calls push "
        "refused (ShapeError): got (5,); rank(s) 2 calls push refused (ShapeError): got (6,)")


def test_words_are_said_where_a_rank_is_at_another_call():
    calls = {0: (3, PUSH, None), 1: (4, REFUSED, "got (5,)")}
    assert agree._told(_Ranks(), calls) == (
        "rank(s) 0 at collective call #3 (push assigning the sum of key 1, key 2, key 3); "
        "rank(s) 1 at collective call #4 (push refused (ShapeError): got (5,))")
