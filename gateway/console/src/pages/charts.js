// TTFT, TPOT, error rate and throughput per backend over the last minutes, drawn by uPlot from /admin/series
// (5 s buckets; an empty bucket is a gap in the latency and error lines).
import uPlot from "uplot";
import { api } from "../api.js";
import { h } from "../dom.js";

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];
const WINDOWS = [[300, "5 min"], [600, "10 min"], [1800, "30 min"]];
const HEIGHT = 200;

const ms = (seconds) => `${(1000 * seconds).toFixed(seconds < 0.01 && seconds > 0 ? 1 : 0)} ms`;

// each chart: which measures of each backend it draws, and how its axis reads
const CHARTS = [
  { id: "ttft", title: "Time to first token", measures: [["ttft_p50_s", "p50"], ["ttft_p95_s", "p95"]], unit: ms },
  { id: "tpot", title: "Time per output token (p50)", measures: [["tpot_p50_s", "p50"]], unit: ms },
  { id: "errors", title: "Error rate (5xx and backend errors)", measures: [["error_rate", ""]],
    unit: (v) => `${(100 * v).toFixed(0)}%` },
  { id: "requests", title: "Requests per second", measures: [["requests_per_s", ""]], unit: (v) => v.toFixed(2) },
  { id: "tokens", title: "Output tokens per second", measures: [["tokens_per_s", ""]], unit: (v) => v.toFixed(1) },
];

function options(chart, backends, width) {
  const series = [{}];
  backends.forEach((b, i) => chart.measures.forEach(([, label], j) => series.push({
    label: label ? `${b} ${label}` : b, stroke: COLORS[i % COLORS.length], width: 2, dash: j ? [6, 4] : undefined,
    value: (u, v) => (v === null || v === undefined ? "–" : chart.unit(v)),
  })));
  return {
    width, height: HEIGHT, series,
    scales: { x: { time: true }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
    axes: [{ space: 60 }, { size: 80, values: (u, ticks) => ticks.map((v) => chart.unit(v)) }],
  };
}

function columns(chart, data, backends) {
  const first = data.backends[backends[0]];
  return [first.t, ...backends.flatMap((b) => chart.measures.map(([m]) => data.backends[b][m]))];
}

export default {
  title: "Backends over time",
  create(root) {
    let seconds = 600;
    let plots = {}; // chart id → uPlot
    let shape = ""; // the backends the plots were made for
    const picker = h("div", { class: "windows" }, WINDOWS.map(([s, label]) => h("button", { type: "button",
      "data-seconds": s, class: s === seconds ? "active" : "", onclick: (e) => {
        seconds = s;
        for (const b of picker.children) b.classList.toggle("active", b === e.target);
        view.refresh();
      } }, label)));
    const grid = h("div", { class: "charts" });
    root.replaceChildren(picker, grid);
    const width = () => Math.max(320, Math.floor((grid.clientWidth || 900) / 2) - 24);
    const onResize = () => Object.values(plots).forEach((p) => p.setSize({ width: width(), height: HEIGHT }));
    window.addEventListener("resize", onResize);
    const destroy = () => {
      Object.values(plots).forEach((p) => p.destroy());
      plots = {};
    };
    const view = {
      async refresh() {
        const data = await api(`/admin/series?seconds=${seconds}`);
        const backends = Object.keys(data.backends);
        if (!backends.length) {
          destroy();
          shape = "";
          grid.replaceChildren(h("p", { class: "muted" }, "no backends"));
          return;
        }
        if (shape !== backends.join("\n")) { // new backends (a reload): new plots
          destroy();
          grid.replaceChildren();
          for (const chart of CHARTS) {
            const box = h("figure", { class: "chart", id: `chart-${chart.id}` }, h("figcaption", {}, chart.title));
            grid.append(box);
            plots[chart.id] = new uPlot(options(chart, backends, width()), columns(chart, data, backends), box);
          }
          shape = backends.join("\n");
        } else {
          for (const chart of CHARTS) plots[chart.id].setData(columns(chart, data, backends));
        }
      },
      destroy() {
        window.removeEventListener("resize", onResize);
        destroy();
      },
    };
    return view;
  },
};
