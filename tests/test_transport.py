"""The transport (``_transport``): framed messages over a socket, read by ``Receiver``."""

from __future__ import annotations

import torch


def test_receiver_returns_messages_sent_just_before_the_sender_closed() -> None:
    import socket

    from resumable_loader._transport import Receiver, send

    ours, theirs = socket.socketpair()
    recv = Receiver(ours)
    try:
        send(theirs, ("last", "words"))
        send(theirs, ("and", torch.arange(3)))
        theirs.close()  # the worker exits right after sending
        msgs = recv.feed()
        assert recv.eof, "the closed end must be noticed"
        assert [m[0] for m in msgs] == ["last", "and"], "whole messages before EOF are kept"
        assert torch.equal(msgs[1][1], torch.arange(3))
        assert recv.feed() == [] and recv.eof
    finally:
        recv.close()
