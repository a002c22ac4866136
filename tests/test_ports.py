"""serving.ports: ports for servers that bind later are drawn outside the range the
kernel hands out unasked, and are free when returned."""
import socket

from serving import ports


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    low, high = ports._ephemeral_range()
    for span in (1, 2):
        p = ports.free_port(span=span)
        assert ports._FLOOR <= p and p + span - 1 <= ports._TOP
        assert p + span - 1 < low or p > high
        for q in range(p, p + span):
            with socket.socket() as s:
                s.bind(("127.0.0.1", q))


def test_a_wide_ephemeral_range_leaves_the_ports_above_it(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 60000))
    assert ports._outside_ephemeral(2) == [range(60001, 65535)]
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    assert ports._outside_ephemeral(1) == [range(10000, 65536)]  # nothing outside: any


def test_free_port_skips_a_taken_port(monkeypatch):
    """The first draw is a port someone holds: another, free one is returned."""
    taken = ports.free_port()
    index = 0  # the draw that means `taken`
    for r in ports._outside_ephemeral(1):
        if taken in r:
            index += r.index(taken)
            break
        index += len(r)
    real, draws = ports.random.SystemRandom(), [index]

    class FirstTaken:
        def randrange(self, n):
            return draws.pop() if draws else real.randrange(n)

    with socket.socket() as held:
        held.bind(("127.0.0.1", taken))
        monkeypatch.setattr(ports.random, "SystemRandom", FirstTaken)
        p = ports.free_port()
        assert not draws and p != taken
