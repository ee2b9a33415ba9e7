// The shadow parity report (/admin/migrations): per model and backend pair, how often the candidate's answer
// matched the primary's, both sides' latency and errors; then the last diverging answers, diffed by jsdiff.
import { diffWordsWithSpace } from "diff";
import { api } from "../api.js";
import { fmt, h, table } from "../dom.js";

function pairRow(p) {
  const a = p.primary_stats;
  const b = p.candidate_stats;
  return h("tr", { class: "pair", "data-model": p.model },
    h("td", {}, p.model), h("td", {}, `${p.primary} → ${p.candidate}`), h("td", {}, p.compared),
    h("td", {}, fmt.pct(p.exact_match_rate)), h("td", {}, fmt.pct(p.mean_common_prefix_ratio)), h("td", {}, p.dropped),
    h("td", {}, `${fmt.ms(a.ttft_p50_s)} / ${fmt.ms(b.ttft_p50_s)}`),
    h("td", {}, `${fmt.ms(a.ttft_p95_s)} / ${fmt.ms(b.ttft_p95_s)}`),
    h("td", {}, `${fmt.ms(a.latency_p95_s)} / ${fmt.ms(b.latency_p95_s)}`),
    h("td", {}, `${fmt.pct(a.error_rate)} / ${fmt.pct(b.error_rate)}`),
    h("td", {}, `${fmt.num(a.mean_tokens, 1)} / ${fmt.num(b.mean_tokens, 1)}`));
}

function divergence(d) {
  // words the primary said and the candidate did not are struck out, the candidate's own are underlined
  const parts = diffWordsWithSpace(d.primary_text, d.candidate_text).map((part) => h(part.removed ? "del"
    : part.added ? "ins" : "span", {}, part.value));
  return h("article", { class: "divergence", "data-model": d.model },
    h("header", {}, h("strong", {}, d.model), ` ${d.primary} → ${d.candidate}`,
      h("span", { class: "muted" }, ` ${fmt.time(d.at)}`),
      d.truncated ? h("span", { class: "tag" }, "truncated") : null),
    h("pre", { class: "diff" }, parts));
}

export default {
  title: "Shadow parity",
  create(root) {
    return {
      async refresh() {
        const data = await api("/admin/migrations");
        const pairs = data.pairs.length
          ? table(["Model", "Primary → candidate", "Compared", "Exact match", "Common prefix", "Dropped",
            "TTFT p50 (prim. / cand.)", "TTFT p95", "Latency p95", "Errors", "Mean tokens"], data.pairs.map(pairRow),
          { id: "pairs" })
          : h("p", { class: "muted", id: "no-pairs" },
            "No mirrored traffic yet: give a model a [models.<name>.shadow] table, or start a rollout with a "
            + "shadow phase.");
        const divergences = (data.divergences || []).map(divergence);
        root.replaceChildren(pairs, h("h3", {}, "Diverging answers"),
          h("p", { class: "legend" }, h("del", {}, "primary only"), " ", h("ins", {}, "candidate only")),
          divergences.length ? h("div", { id: "divergences" }, divergences)
            : h("p", { class: "muted" }, "none kept (the last 20 per pair are)"));
      },
    };
  },
};
