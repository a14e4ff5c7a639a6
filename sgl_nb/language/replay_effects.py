"""What a re-run does instead of engine work (the executor's side, like effects.py): a
replayed gen appends its recorded text and binds it, with its recorded tokens; an edited
one its new value; a replayed or edited select its choice. The Instructions still start and
finish (their events say `replayed` / `edited`), so a re-run's listing and trace show the
same steps as any run."""

from __future__ import annotations

from sgl_nb.language.reasoning import split_reasoning
from sgl_nb.language.replay import MISSING, Step, Stepped
from sgl_nb.runtime.compiler.ir import GenNode, JoinNode, Node


class ReplayEffects:
    """A mixin of ProgramEffects (the state holds the data: replay, _steps)."""

    def _replay_step(self, node: Node) -> None:
        """At a Node's start: what the re-run does with it (kept for its Instructions)."""
        if self.replay is None:
            return
        branches = []
        if isinstance(node, JoinNode):
            branches = [c.replay for c in self._children if c.id in node.branches and c.replay]
        stepped = self._steps[node.id] = self.replay.step(node, branches)
        if stepped.step is Step.EDIT and isinstance(node, GenNode) and self.replay.edit.sampling:
            node.sampling.update(self.replay.edit.sampling)  # its events and record show them

    def _stepped(self, node: Node | None) -> Stepped | None:
        """The re-run's decision for `node` when it is not to run live as recorded."""
        s = self._steps.get(node.id) if node is not None else None
        if s is None or s.step is Step.LIVE:
            return None
        if s.step is Step.EDIT and self.replay.edit.value is MISSING:
            return None  # only its sampling arguments change: it runs live with them
        return s

    def _edited_params(self, node: Node, params: dict) -> dict:
        """The Decode's params (lowered before the edit was known) with the edit's."""
        s = self._steps.get(node.id)
        if s is not None and s.step is Step.EDIT:
            return {**params, **self.replay.edit.sampling}
        return params

    def _edited_text(self, node: Node, text: str) -> str:
        s = self._stepped(node)
        return str(self.replay.edit.value) if s is not None and s.step is Step.EDIT else text

    def _replay_gen(self, node: Node, g, s: Stepped, done) -> None:
        edited = s.step is Step.EDIT
        text = str(self.replay.edit.value) if edited else s.record.text
        flag = "edited" if edited else "replayed"
        self._append(text, g.name)
        if not edited:
            self._tokens[node.id] = list(s.record.tokens)
        if g.name is not None:
            usage = s.record.usage
            self._meta[g.name] = {"finish_reason": usage.get("finish_reason"),
                                  "completion_tokens": 0 if edited else usage.get(
                                      "output_tokens", len(s.record.tokens)), flag: True}
            out = text
            if g.reasoning is not None:
                reasoning, out = split_reasoning(out, g.reasoning)
                self[g.name + "_reasoning_content"] = reasoning
            try:
                self[g.name] = g.convert(out)
            except (TypeError, ValueError) as e:
                done(e, {flag: True})
                return
        done(None, {flag: True, "output_tokens": 0})

    def _replay_scores(self, node: Node, s: Stepped, dones: list) -> list[None]:
        edited = s.step is Step.EDIT
        self._chosen[node.id] = (str(self.replay.edit.value) if edited else s.record.text,
                                 "edited" if edited else "replayed")
        for done in dones:
            done(None, {self._chosen[node.id][1]: True})
        return [None] * len(dones)

    def _replay_choice(self, node: Node, sel) -> bool:
        """A replayed or edited Select's choice, appended and bound; False if it has none."""
        picked = self._chosen.pop(node.id, None)
        if picked is None:
            return False
        choice, flag = picked
        self._append(choice, sel.name)
        if sel.name is not None:
            self._meta[sel.name] = {"choices": list(sel.choices), flag: True}
            self[sel.name] = choice
        return True
