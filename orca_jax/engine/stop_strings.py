"""A request's stop strings as one Aho-Corasick automaton: each character of the output is read once,
whatever the number of stop strings.

Searching every stop string in every token's text cost n_stop x window per token and request: 100,000
stop strings on 64 sequences made each iteration ~2 s (benchmarks/probes/stop_strings_cost.py). Here a
token's text costs about one dict lookup per character; building costs ~2 us per character of the stop
strings (pure Python), which SamplingConfig.max_stop_chars bounds. pyahocorasick was measured and left
out: its AutomatonSearchIter.set(), the call that feeds text in pieces, corrupts the heap when the pieces
mix characters above U+FFFF with others (its issue #221; an emoji after plain text crashed us too).
"""

from __future__ import annotations

import collections


class StopStringAutomaton:
    """The automaton of one list of stop strings; immutable once built, so requests with the same list
    share it (each keeps its own state, an int)."""

    __slots__ = ("strings", "_goto", "_fail", "_match", "_depth")

    def __init__(self, strings: tuple[str, ...]):
        if not strings or not all(strings):
            raise ValueError("a stop-string automaton needs at least one string, none empty")
        self.strings = strings
        # The trie's edges in one dict keyed by state * _CHARS + code point: no object per state, so
        # the garbage collector has nothing to walk however many strings there are.
        goto: dict[int, int] = {}
        children: list[list[int]] = [[]]  # state -> the keys of its edges (for the breadth-first pass)
        depth = [0]  # state -> the length of the prefix it stands for
        is_stop = [False]
        for string in strings:
            state = 0
            for char in string:
                key = state * _CHARS + ord(char)
                nxt = goto.get(key)
                if nxt is None:
                    nxt = goto[key] = len(depth)
                    children[state].append(key)
                    children.append([])
                    depth.append(depth[state] + 1)
                    is_stop.append(False)
                state = nxt
            is_stop[state] = True
        # fail: the state of the longest proper suffix that is also a prefix; match: the length of
        # the longest stop string ending here (0: none), which is the match that starts earliest.
        fail, match = [0] * len(depth), [0] * len(depth)
        queue = collections.deque(goto[key] for key in children[0])
        for child in queue:
            match[child] = depth[child] if is_stop[child] else 0
        while queue:
            state = queue.popleft()
            for key in children[state]:
                child, code = goto[key], key % _CHARS
                back = fail[state]
                while back and back * _CHARS + code not in goto:
                    back = fail[back]
                fail[child] = goto.get(back * _CHARS + code, 0)
                match[child] = depth[child] if is_stop[child] else match[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._match, self._depth = goto, fail, match, depth

    def scan(self, state: int, text: str) -> tuple[int, tuple[int, int] | None]:
        """Feed text from `state` (0: the start); returns the state after it and the stop string that
        starts earliest among those ending inside text, as (start, length) with start relative to text
        (negative: it began before), or None. At equal starts the shorter one wins (it ends first)."""
        goto, fail, match = self._goto, self._fail, self._match
        best = None
        for end, char in enumerate(text, 1):
            code = ord(char)
            while state and state * _CHARS + code not in goto:
                state = fail[state]
            state = goto.get(state * _CHARS + code, 0)
            length = match[state]
            if length and (best is None or end - length < best[0]):
                best = (end - length, length)
        return state, best

    def partial_length(self, state: int) -> int:
        """How many of the last characters fed could still begin a stop string (hold them back)."""
        return self._depth[state]


_CHARS = 0x110000  # code points: state * _CHARS + ord(char) names an edge
