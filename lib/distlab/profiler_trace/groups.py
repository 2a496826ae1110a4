"""Which process group a recorded call ran in, and so which global rank its peer is.

c10d records a send's peer as the rank inside the call's group, and on gloo nothing in the event
says which group that was ("Concrete Inputs" carry the peer and the tag, the ProcessGroup argument
is blank). What a file can tell:
- the event's own args, where the backend writes them (NCCL's "Process Group Ranks", or a
  "Process Group Name" / "Process Group Description" to look up in the file's pg_config);
- otherwise the groups the file lists for its rank (distributedInfo.pg_config): a group-local peer
  p is rank g[p] of one of them, never the rank itself (c10d refuses a send to oneself). When the
  groups disagree on g[p], or the file lists no groups, the peer stays unknown (None): an unknown
  peer is honest, a peer read through the wrong group is a wrong rank.
"""
import json

from .files import _default_group


class Groups:
    """The process groups one rank's file lists, to read its events' groups and peers."""

    def __init__(self, doc, rank):
        info = doc.get("distributedInfo")
        configs = (info.get("pg_config") if isinstance(info, dict) else None) or []
        self.rank = rank
        self.default = _default_group(doc)
        self.listed, self.by_name = [], {}
        for pg in configs if isinstance(configs, list) else []:
            ranks = _ranks(pg.get("ranks")) if isinstance(pg, dict) else None
            if not ranks:
                continue
            if ranks not in self.listed:
                self.listed.append(ranks)
            for key in ("pg_name", "pg_desc"):
                if pg.get(key) not in (None, "", "undefined"):
                    self.by_name.setdefault(str(pg[key]), ranks)

    def named(self, args):
        """The group an event's args name, or None."""
        ranks = _ranks(args.get("Process Group Ranks"))
        if ranks:
            return ranks
        for key in ("Process Group Name", "Process Group Description"):
            if args.get(key) is not None and str(args[key]) in self.by_name:
                return self.by_name[str(args[key])]
        return None

    def _candidates(self):
        mine = [g for g in self.listed if self.rank in g]
        return mine or self.listed

    def of(self, args):
        """The event's group: the one its args name, else the only group the rank is in, else
        (the file lists none) the default group; None where several could be."""
        named = self.named(args)
        if named:
            return named
        candidates = self._candidates()
        if not candidates:
            return self.default
        return candidates[0] if len(candidates) == 1 else None

    def peer(self, args, local):
        """The global rank of group-local peer `local`, or None where the file cannot tell."""
        if local is None or local < 0:
            return None
        named = self.named(args)
        if named:
            return named[local] if local < len(named) else None
        found = {g[local] for g in self._candidates() if local < len(g)} - {self.rank}
        return found.pop() if len(found) == 1 else None


def _ranks(value):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(r, int) and not isinstance(r, bool) for r in value):
        return tuple(value)
    return None
