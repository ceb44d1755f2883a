"""README.md is `nbs/index.ipynb`'s markdown, as nbdev projects have it. `nbdev-readme` would render it, but it needs
Quarto, which this project does not install; so the two hold the same text and this test says where they differ.
Edit the notebook, then `python tests/test_readme.py` writes README.md from it. Pure text: no torch, no fastai."""
import json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX, README, CI = ROOT/'nbs'/'index.ipynb', ROOT/'README.md', ROOT/'.ci'/'run'
MAX_LINES = 200

def readme_from_index(path=INDEX) -> str:
    "The README's text: the notebook's markdown cells, one blank line between them"
    cells = json.loads(Path(path).read_text(encoding='utf-8'))['cells']
    kinds = sorted({c['cell_type'] for c in cells})
    assert kinds == ['markdown'], f"{path} holds {kinds} cells; keep it markdown only (nbdev-test would run a code cell)"
    return '\n\n'.join(''.join(c['source']).strip('\n') for c in cells) + '\n'

def test_readme_is_the_index_notebook():
    want, have = readme_from_index(), README.read_text(encoding='utf-8')
    if have == want: return
    w, h = want.splitlines(), have.splitlines()
    n = next((i for i, (a, b) in enumerate(zip(w, h)) if a != b), min(len(w), len(h)))
    raise AssertionError(f"README.md differs from nbs/index.ipynb at line {n + 1}:\n  notebook: {w[n] if n < len(w) else '(end)'!r}\n"
                         f"  README:   {h[n] if n < len(h) else '(end)'!r}\nEdit nbs/index.ipynb, then run: python tests/test_readme.py")

def test_readme_is_short():
    n = len(README.read_text(encoding='utf-8').splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; at most {MAX_LINES}: move details to the notebooks and link them"

def test_readme_links_point_into_the_repository():
    "Every relative link resolves inside the checkout, and no path leaves it"
    readme = README.read_text(encoding='utf-8')
    assert '../' not in readme, "README.md names a path outside the repository"
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if '://' in target: continue
        assert (ROOT/target).exists(), f"README.md links {target}, which does not exist"

def test_ci_runs_the_readme_test_command():
    "`.ci/run` runs the README's test command and its install (the GPU one: CI installs what a user gets from PyPI)"
    readme, ci = README.read_text(encoding='utf-8'), CI.read_text(encoding='utf-8')
    cmd = re.search(r"## Run the tests\n.*?```bash\n(.*?)\n```", readme, re.S).group(1).strip()
    assert cmd in [l.strip() for l in ci.splitlines()], f".ci/run does not run the README's test command: {cmd}"
    assert 'pip install -e ".[dev]"' in readme and '-e ".[dev]"' in ci

if __name__ == '__main__':
    README.write_text(readme_from_index(), encoding='utf-8')
    print(f"README.md written from {INDEX.relative_to(ROOT)} ({len(README.read_text(encoding='utf-8').splitlines())} lines)")

def test_github_runs_the_ci_script_and_deploys_the_docs():
    "nbdev's two GitHub workflows: every push runs `.ci/run` (what CI runs); a push to main builds the docs site with Quarto for GitHub Pages"
    import pytest
    yaml = pytest.importorskip('yaml')
    wf = ROOT/'.github'/'workflows'
    test, deploy = (yaml.safe_load((wf/f).read_text()) for f in ('test.yaml', 'deploy.yaml'))
    on = lambda w: w.get('on', w.get(True))   # YAML 1.1 reads the key `on` as True
    assert {'push', 'pull_request'} <= set(on(test)), on(test)
    assert [s['run'] for s in test['jobs']['test']['steps'] if 'run' in s] == ['bash .ci/run']
    assert on(deploy)['push']['branches'] == ['main', 'master'] and deploy['permissions'] == {'contents': 'write', 'pages': 'write'}
    assert [s['uses'].split('@')[0] for s in deploy['jobs']['deploy']['steps']] == ['AnswerDotAI/workflows/quarto-ghp3']
