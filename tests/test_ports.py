"""serving.ports: ports for servers that bind later are drawn outside the range the
kernel hands out unasked, and are free when returned."""
import socket

from serving import ports


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = ports._ephemeral_low()
    for span in (1, 2):
        p = ports.free_port(span=span)
        assert ports._FLOOR <= p and p + span - 1 < low
        for q in range(p, p + span):
            with socket.socket() as s:
                s.bind(("127.0.0.1", q))


def test_free_port_skips_a_taken_port(monkeypatch):
    """The first draw is a port someone holds: another, free one is returned."""
    real = ports.random.SystemRandom()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        draws = [held.getsockname()[1]]

        class FirstTaken:
            def randrange(self, lo, hi):
                return draws.pop() if draws else real.randrange(lo, hi)

        monkeypatch.setattr(ports.random, "SystemRandom", FirstTaken)
        p = ports.free_port()
        assert not draws and p != held.getsockname()[1]
