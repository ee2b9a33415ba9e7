// Models and their backends: routes with weights, fallbacks, shadow, and each backend's state.
import { api } from "../api.js";
import { fmt, h, stateClass, table } from "../dom.js";

function backendCell(name, state) {
  return h("span", { class: `backend ${stateClass(state)}`, title: state }, name);
}

function weights(routes) {
  // a bar split by each route's share, so a 95/5 split reads at a glance
  return h("div", { class: "split" },
    routes.map((r, i) => h("span", { class: `share c${i % 6}`, style: `flex-grow: ${r.share}`,
      title: `${r.backend}: weight ${r.weight} (${fmt.pct(r.share)})` }, `${r.backend} ${fmt.pct(r.share, 0)}`)));
}

const SETTLED = new Set(["promoted", "rolled_back", "aborted"]);

// a rollout under way splits the model between its baseline and its candidate, whatever config.toml says
function liveRoutes(m, r) {
  if (!r || SETTLED.has(r.state)) return m.routes;
  const w = r.weight / 100;
  return [{ backend: r.baseline, weight: 100 - r.weight, share: 1 - w },
    { backend: r.candidate, weight: r.weight, share: w }];
}

function rolloutNote(r) {
  if (!r) return null;
  return h("a", { href: "#/rollouts", class: "rollout-note" },
    `rollout ${r.state}: ${r.candidate} at ${r.weight}%`);
}

export default {
  title: "Models and backends",
  create(root) {
    return {
      async refresh() {
        const [data, live] = await Promise.all([api("/admin/models"), api("/admin/rollouts")]);
        // /admin/models gives the configured weights; a rollout in progress moves them
        const rollouts = Object.fromEntries(live.rollouts.map((r) => [r.model, r]));
        document.getElementById("version").textContent = `config ${data.config_version}`;
        const rows = data.models.map((m) => h("tr", { class: "model", "data-model": m.name },
          h("td", {}, h("strong", {}, m.name), m.default ? h("span", { class: "tag" }, "default") : null),
          h("td", {}, m.aliases.join(", ") || "–"),
          h("td", {}, weights(liveRoutes(m, rollouts[m.name])), rolloutNote(rollouts[m.name])),
          h("td", {}, m.fallback.length ? m.fallback.map((b) => backendCell(b, m.backends[b])) : "–"),
          h("td", {}, m.shadow ? [backendCell(m.shadow.backend, m.backends[m.shadow.backend]),
            ` ${fmt.pct(m.shadow.sample, 0)}`] : "–"),
          h("td", {}, m.sticky || "–")));
        const backends = Object.entries(data.backends).map(([name, b]) => h("tr", { class: "backend-row",
          "data-backend": name },
        h("td", {}, backendCell(name, b.state)), h("td", {}, b.type),
        h("td", { class: stateClass(b.state) }, b.state)));
        root.replaceChildren(
          table(["Model", "Aliases", "Routes (weight)", "Fallback", "Shadow", "Sticky"], rows, { id: "models" }),
          h("h3", {}, "Backends"),
          table(["Backend", "Type", "State"], backends, { id: "backends" }));
      },
    };
  },
};
