// Rollouts: each one's steps, its gates (live value against threshold), its decision log and the buttons that
// steer it. Everything comes from /admin/rollouts; a button POSTs and the page reloads from the answer.
import { ApiError, api } from "../api.js";
import { fmt, h, table } from "../dom.js";

const TERMINAL = new Set(["promoted", "rolled_back", "aborted"]);
// which actions make sense in which state (the API is the judge; this only greys out the obvious)
const ACTIONS = [
  ["pause", (s) => s === "running" || s === "shadow"],
  ["resume", (s) => s === "paused"],
  ["promote", (s) => !TERMINAL.has(s)],
  ["step-back", (s) => s === "running" || s === "paused"],
  ["abort", (s) => !TERMINAL.has(s)],
];
const CONFIRM = {
  promote: "send all of this model's traffic to the candidate now",
  abort: "end this rollout and send all traffic back to the baseline",
};

function steps(r) {
  // the shadow phase (step -1, where the rollout has one) first, then one segment per step; done, current and
  // to come look different
  const shadowed = r.step === -1 || (r.spec?.shadow_seconds ?? 0) > 0;
  const cells = [...(shadowed ? [{ label: "shadow", index: -1 }] : []),
    ...r.steps.map((p, i) => ({ label: `${p}%`, index: i }))];
  return h("ol", { class: "steps" }, cells.map((c) => {
    const where = c.index < r.step ? "done" : c.index === r.step ? "current" : "todo";
    return h("li", { class: `step ${where}`, "data-step": c.index,
      "aria-current": where === "current" ? "step" : null }, c.label);
  }));
}

function gateValue(x) {
  return x === null || x === undefined ? "–" : Number(x).toPrecision(3);
}

function gates(r) {
  if (!r.gates?.length) {
    return h("p", { class: "muted no-gates" }, "no gate figures yet (the first look at this step is still to come)");
  }
  const rows = r.gates.map((g) => h("tr", { class: `gate ${g.status}`, "data-gate": g.name },
    h("td", {}, g.name),
    h("td", { class: "value" }, gateValue(g.value)),
    h("td", {}, gateValue(g.threshold)),
    h("td", {}, g.low === null && g.high === null ? "–" : `[${gateValue(g.low)}, ${gateValue(g.high)}]`),
    h("td", {}, `${g.baseline_samples} / ${g.candidate_samples}`),
    h("td", { class: "status" }, g.status),
    h("td", { class: "detail" }, g.detail || "")));
  return table(["Gate", "Value", "Threshold", "Interval", "Samples (base / cand.)", "Status", "Detail"], rows,
    { class: "gates" });
}

function decisions(r) {
  const rows = [...(r.decisions || [])].reverse().map((d) => h("tr", { class: `decision ${d.action}` },
    h("td", {}, fmt.time(d.at)), h("td", {}, d.action), h("td", {}, d.step), h("td", {}, `${d.weight}%`),
    h("td", {}, d.by || ""), h("td", {}, d.reason || "")));
  return rows.length ? table(["At", "Action", "Step", "Weight", "By", "Reason"], rows, { class: "decisions" })
    : h("p", { class: "muted" }, "no decisions yet");
}

// the replica that steers the rollout: this one (true), another (false or its name), or no store to lead (null)
function leader(value) {
  if (value === null || value === undefined) return null;
  const text = value === true ? "steered by this replica" : value === false ? "steered by another replica"
    : `steered by ${value}`;
  return h("span", { class: "muted" }, text);
}

function card(r, ctx, errors) {
  const act = async (action) => {
    if (CONFIRM[action] && !window.confirm(`${action} ${r.model}: ${CONFIRM[action]}?`)) return;
    try {
      await api(`/admin/rollouts/${encodeURIComponent(r.model)}/${action}`, { method: "POST" });
      errors.delete(r.model);
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      errors.set(r.model, `${action}: ${err.message}`);
    }
    await ctx.reload();
  };
  const buttons = ACTIONS.map(([action, allowed]) => h("button", { type: "button", class: `action ${action}`,
    "data-action": action, disabled: !allowed(r.state), onclick: () => act(action) }, action));
  return h("article", { class: "rollout", "data-model": r.model, "data-state": r.state },
    h("header", {},
      h("h3", {}, r.model, " ", h("span", { class: "muted" }, `${r.baseline} → ${r.candidate}`)),
      h("span", { class: `badge state ${r.state}` }, r.state),
      h("span", { class: "weight" }, `candidate at ${r.weight}%`),
      leader(r.leader),
      h("span", { class: "muted" }, `step since ${fmt.time(r.step_started)}`)),
    steps(r),
    h("div", { class: "actions" }, buttons),
    errors.has(r.model) ? h("p", { class: "error" }, errors.get(r.model)) : null,
    r.detailError ? h("p", { class: "error" }, `its decision log: ${r.detailError}`) : null,
    h("h4", {}, "Gates"), gates(r),
    h("h4", {}, "Decision log"), decisions(r));
}

export default {
  title: "Rollouts",
  create(root, ctx) {
    const errors = new Map(); // model → the last refused action, shown until the next one
    return {
      async refresh() {
        const data = await api("/admin/rollouts");
        // the list leaves the decision logs out: each rollout's own answer has its log
        const list = await Promise.all((data.rollouts || []).map((r) =>
          api(`/admin/rollouts/${encodeURIComponent(r.model)}`).catch((err) => {
            if (!(err instanceof ApiError)) throw err;
            return { ...r, detailError: err.message }; // gone since the list: show what the list said
          })));
        root.replaceChildren(list.length ? h("div", { id: "rollouts" }, list.map((r) => card(r, ctx, errors)))
          : h("p", { id: "no-rollouts", class: "muted" },
            "No rollouts. Start one with POST /admin/rollouts or a [models.<name>.rollout] table in config.toml."));
      },
    };
  },
};
