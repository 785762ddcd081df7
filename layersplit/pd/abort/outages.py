"""What each injected outage cost, measured in the stress (virtual seconds, decode pages).

For a partition of a rank's control link or a long prefill outage (crash, restart ``seconds`` later:
a model reload): the peak of pages held by aborted requests awaiting acks during the outage, what was
still held at the heal, how long after the heal the last of those was released (``None``: never — held
for ever), the longest abort -> release of a request aborted during the outage (``None``: one is held
for ever) and the fences of that rank meanwhile. For a permanent kill: when the rank was fenced and
when the last request waiting on it was released.
"""

from __future__ import annotations


class OutageWatch:
    def __init__(self, cluster) -> None:  # a layersplit.pd.abort.cluster.PDCluster (not imported: it imports this)
        self.cluster = cluster
        self.outages: list[dict] = []
        self._held_at_heal: dict[int, set[int]] = {}  # outage index -> rooms awaiting acks at the heal

    def schedule(self) -> None:
        cfg, loop = self.cluster.cfg, self.cluster.loop
        for kind, faults in (("partition", cfg.partition), ("prefill_outage", cfg.outage)):
            for rank, at, seconds in faults:
                index = len(self.outages)
                self.outages.append({"kind": kind, "rank": rank, "start_s": at, "heal_s": at + seconds})
                loop.after(at, self._start, index)
                loop.after(at + seconds, self._heal, index)

    def _start(self, index: int) -> None:
        d = self.cluster.decode
        d.peak_held_aborted_pages = d.held_aborted_pages  # the peak from here on

    def _heal(self, index: int) -> None:
        d, o = self.cluster.decode, self.outages[index]
        o["peak_held_aborted_pages"] = d.peak_held_aborted_pages
        held = {room for room, r in d.reqs.items() if r.unacked}
        o["held_at_heal_pages"] = sum(len(d.reqs[room].pages) for room in held)
        self._held_at_heal[index] = held

    def report(self) -> dict:
        d = self.cluster.decode
        released = {room: t for t, room in d.releases}
        holds = [(t - held, held) for (t, _), held in zip(d.releases, d.release_latencies)]  # (aborted at, held)
        outages = []
        for index, o in enumerate(self.outages):
            held = self._held_at_heal.get(index, set())
            still = [room for room in held if room in d.reqs]
            times = [released[room] - o["heal_s"] for room in held if room in released]
            fences = [round(t, 3) for rank, _, t in d.fences if rank == o["rank"] and t >= o["start_s"]]
            longest = max((held for at, held in holds if o["start_s"] <= at <= o["heal_s"]), default=0.0)
            outages.append({**o, "release_after_heal_s": None if still else round(max(times, default=0.0), 4),
                            "longest_abort_hold_s": None if still else round(longest, 4),
                            "still_held_at_end_pages": sum(len(d.reqs[room].pages) for room in still),
                            "fenced_at_s": fences})
        kills = []
        for rank, at in self.cluster.cfg.kill:
            fenced = [t for r, _, t in d.fences if r == rank and t >= at]
            after = [t for t, _ in d.releases if fenced and t >= fenced[0]]
            kills.append({"rank": rank, "killed_at_s": at,
                          "fenced_after_s": round(fenced[0] - at, 4) if fenced else None,
                          "fence_to_release_s": round(after[0] - fenced[0], 4) if fenced and after else None})
        return {"outages": outages, "kills": kills}
