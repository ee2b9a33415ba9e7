// Building elements from data: text always goes in as text nodes, never as HTML.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "class") el.className = value;
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function table(headers, rows, attrs = {}) {
  return h("table", attrs, h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))), h("tbody", {}, rows));
}

export const fmt = {
  num(x, digits = 2) {
    return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
  },
  pct(x, digits = 1) {
    return x === null || x === undefined ? "–" : `${(100 * x).toFixed(digits)}%`;
  },
  ms(seconds) {
    return seconds === null || seconds === undefined ? "–" : `${(1000 * seconds).toFixed(1)} ms`;
  },
  time(unix) {
    return unix ? new Date(unix * 1000).toLocaleString() : "–";
  },
};

// healthy → ok, starting/ejected → warn, failed/unhealthy → bad
export function stateClass(state) {
  if (!state) return "warn";
  if (state.startsWith("healthy")) return "ok";
  if (state.startsWith("failed") || state.startsWith("unhealthy")) return "bad";
  return "warn";
}
