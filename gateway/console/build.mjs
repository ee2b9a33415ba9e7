// Builds static/ from src/ and the pinned npm libraries: one minified script (page code + uPlot + jsdiff), one
// stylesheet (ours + uPlot's), the page, the libraries' licences, and manifest.json, which names the library
// versions and the hashes of what was read and written: tests/test_console.py checks it against package.json,
// package-lock.json, src/ and static/, so a stale or hand-edited bundle fails the suite without node.
// Run with `make console` (npm ci, then this).
import { createHash } from "node:crypto";
import { copyFileSync, readFileSync, readdirSync, rmSync, mkdirSync, writeFileSync } from "node:fs";
import { join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import * as esbuild from "esbuild";

const here = fileURLToPath(new URL(".", import.meta.url));
const out = join(here, "static");
const pkg = JSON.parse(readFileSync(join(here, "package.json"), "utf8"));
const installed = (name) => JSON.parse(readFileSync(join(here, "node_modules", name, "package.json"), "utf8"));
const libs = Object.keys(pkg.dependencies).map((name) => ({ name, version: installed(name).version,
  license: installed(name).license }));
for (const lib of libs) {
  if (lib.version !== pkg.dependencies[lib.name]) {
    throw new Error(`${lib.name}: ${lib.version} installed, ${pkg.dependencies[lib.name]} pinned: run npm ci`);
  }
}
const sha256 = (path) => createHash("sha256").update(readFileSync(path)).digest("hex");
const files = (dir) => readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
  e.isDirectory() ? files(join(dir, e.name)) : [join(dir, e.name)]).sort();

rmSync(out, { recursive: true, force: true });
mkdirSync(out);
const banner = `/*! llm-gateway console | ${libs.map((l) => `${l.name} ${l.version} (${l.license})`).join(" | ")}`
  + ` | esbuild ${esbuild.version} */`;
await esbuild.build({
  entryPoints: [join(here, "src", "main.js")],
  outfile: join(out, "console.js"), // its CSS imports land in console.css
  bundle: true, minify: true, format: "iife", target: ["es2020"], legalComments: "none",
  banner: { js: banner, css: banner }, logLevel: "warning",
});
copyFileSync(join(here, "src", "index.html"), join(out, "index.html"));
writeFileSync(join(out, "THIRD_PARTY_LICENSES.txt"), libs.map((l) => `${l.name} ${l.version} (${l.license})\n\n`
  + readFileSync(join(here, "node_modules", l.name, "LICENSE"), "utf8").trim() + "\n").join("\n\n"));

const inputs = ["package.json", "package-lock.json", "build.mjs", ...files(join(here, "src")).map((p) => relative(here, p))];
const outputs = readdirSync(out).sort();
const manifest = {
  note: "written by build.mjs (make console); checked by tests/test_console.py",
  packages: Object.fromEntries(libs.map((l) => [l.name, l.version])),
  esbuild: esbuild.version,
  inputs: Object.fromEntries(inputs.map((p) => [p, sha256(join(here, p))])),
  outputs: Object.fromEntries(outputs.map((p) => [p, sha256(join(out, p))])),
};
writeFileSync(join(out, "manifest.json"), JSON.stringify(manifest, null, 2) + "\n");
console.log(`static/: ${outputs.map((p) => `${p} ${readFileSync(join(out, p)).length} B`).join(", ")}`);
