// Keys and usage (/admin/keys, /admin/usage): they exist with a state database ([state] in config.toml); without
// one the keys are config.toml's and this page says so rather than calling routes that would refuse.
import { api } from "../api.js";
import { h, table } from "../dom.js";

const limit = (x) => (x === null || x === undefined ? "–" : x.toLocaleString());

export default {
  title: "Keys and usage",
  create(root) {
    return {
      async refresh() {
        const models = await api("/admin/models");
        if (!models.state_store) {
          root.replaceChildren(h("p", { id: "keys-in-config" }, "Keys live in config.toml (",
            h("code", {}, "[[auth.keys]]"), ") and change there. Add a ", h("code", {}, "[state]"),
            " table to manage keys here and to record usage per key."));
          return;
        }
        const [keys, usage] = await Promise.all([api("/admin/keys"), api("/admin/usage?group_by=key,model")]);
        const keyRows = keys.data.map((k) => h("tr",
          { class: `key ${k.revoked_at ? "revoked" : ""}`, "data-key": k.name },
          h("td", {}, k.name), h("td", {}, k.source), h("td", {}, k.models.join(", ") || "all"),
          h("td", {}, limit(k.rpm)), h("td", {}, limit(k.tpm)), h("td", {}, limit(k.max_tokens_per_day)),
          h("td", {}, limit(k.max_tokens_per_month)), h("td", {}, k.expires_at || "–"),
          h("td", {}, k.secret_hint || "–"),
          h("td", {}, k.revoked_at ? `revoked ${k.revoked_at}` : "active")));
        const usageRows = usage.data.map((u) => h("tr", { class: "usage" },
          h("td", {}, u.key ?? "(no key)"), h("td", {}, u.model), h("td", {}, limit(u.requests)),
          h("td", {}, limit(u.prompt_tokens)), h("td", {}, limit(u.completion_tokens)),
          h("td", {}, limit(u.cached_tokens)), h("td", {}, limit(u.errors))));
        root.replaceChildren(
          table(["Key", "Source", "Models", "RPM", "TPM", "Tokens/day", "Tokens/month", "Expires", "Secret", "State"],
            keyRows, { id: "keys" }),
          h("h3", {}, `Usage since ${usage.start}`),
          usageRows.length
            ? table(["Key", "Model", "Requests", "Prompt tokens", "Completion tokens", "Cached", "Errors"], usageRows,
              { id: "usage" }) : h("p", { class: "muted" }, "no usage recorded"));
      },
    };
  },
};
