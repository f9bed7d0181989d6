# Helpers of the model rules (workflow/rules/models.smk; docs/models.md, "Demo models").
import os


def demo_training_fingerprint(name):
    """The training fingerprint of demo model `name` (training code, data generators,
    architecture, settings, seed): rule build_demo_model's `code` param."""
    return demo_model_fingerprint(config["models"][name], config["models"][name]["seed"])


def keep_build_script_older(folder):
    """Committed weights whose training fingerprint matches (checked just before) are current,
    however old their files: their provenance is the fingerprint, not the modification time of
    rule build_demo_model's script. Snakemake reruns a job whose output is older than its
    rule's script, and a fresh clone writes data/models/ before workflow/ (git's path order), so
    the script's modification time is set back to just before the folder's (the time Snakemake
    reads for a directory: its .snakemake_timestamp, else the folder itself). Editing the
    script retrains nothing; a changed fingerprint stops the run at parse time."""
    script = os.path.join(workflow.basedir, "workflow", "scripts", "build_demo_model.py")
    stamp = os.path.join(folder, ".snakemake_timestamp")
    folder_ns = os.stat(stamp if os.path.exists(stamp) else folder).st_mtime_ns
    info = os.stat(script)
    if info.st_mtime_ns >= folder_ns:
        before = folder_ns - 1_000_000_000
        os.utime(script, ns=(info.st_atime_ns, before))


def retrain_hint(message):
    """A stale demo model's one line with the retrain command of this run: its `snakemake`
    carries the run's --configfile options (a demo model's rules exist only under a config that
    names it, e.g. configs/tiny.yaml), with --replace-workflow-config as a run of such a
    config needs (config.yaml's own keys would otherwise stay merged in)."""
    files = [os.path.relpath(f) for f in workflow.overwrite_configfiles]
    if not files:
        return message
    options = " ".join(f"--configfile {f}" for f in files) + " --replace-workflow-config"
    return message.replace("snakemake --cores 2 ", f"snakemake --cores 2 {options} ")
