# Coupled rollouts (docs/architecture.md, "Coupled decoding" and "Rollout jobs"), in two stages per
# study (docs/prespecification.md, "Order of the stages"): dev_rollout_<study> runs the development
# cohort, from which plan_sample_sizes and prespecify (workflow/rules/analysis.smk) write the
# study's plan and lock; rollout_<study> then runs the evaluation cohort with the lock's replicates.
# Each job, one per (model, stratum), loads the model once, prefills each document once and writes
# the trajectory file of every action of the study (under rollout.coupling: swrb, its SWRB record
# file: docs/swrb.md, "Switching it on"). A study split into rollout groups (studies.<s>.groups;
# docs/compare.md, "Rollout groups") runs those two rules for its first group, and for each later
# group rollout_<study>_<group> under the group's amendment lock (rule prespecify_group), with the
# same reference stream X.


include: "helpers/rollouts.smk"


for study in config["studies"]:

    rule:
        name:
            f"dev_rollout_{study}"
        input:
            documents=results("documents/{stratum}.parquet"),
            model=rollout_model_input,
        output:
            **dev_rollout_trajectories(study),
        log:
            logs(f"dev_rollout/{study}/{{model}}/{{stratum}}.log"),
        benchmark:
            results(f"benchmarks/dev_rollout/{study}/{{model}}/{{stratum}}.tsv")
        wildcard_constraints:
            model=wildcard_alternation(config["models"], "no-model"),
            stratum="[^/]+",
        conda:
            "../../envs/kvdiverge.yaml"
        threads: 1
        resources:
            **rollout_resources(),
        params:
            **rollout_params(study, first_group(study), "dev"),
        script:
            f"../scripts/{rollout_script('dev')}"

    for group in rollout_groups(study):

        rule:
            name:
                rollout_rule_name(study, group)
            input:
                documents=results("documents/{stratum}.parquet"),
                model=rollout_model_input,
                lock=group_lock(study, group),
            output:
                **group_trajectories(study, group),
            log:
                logs(f"rollout/{group_folder(study, group)}/{{model}}/{{stratum}}.log"),
            benchmark:
                results(
                    f"benchmarks/rollout/{group_folder(study, group)}/{{model}}/{{stratum}}.tsv"
                )
            wildcard_constraints:
                model=wildcard_alternation(config["models"], "no-model"),
                stratum="[^/]+",
            conda:
                "../../envs/kvdiverge.yaml"
            threads: 1
            resources:
                **rollout_resources(),
            params:
                **rollout_params(study, group, "evaluation"),
            script:
                f"../scripts/{rollout_script('evaluation')}"
