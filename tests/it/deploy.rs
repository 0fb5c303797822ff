//! The files in `deploy/` checked against the binary, so they cannot drift from it: every manifest
//! parses; every `SETTLEMENTD__…` variable and config key they set loads through the binary's own
//! configuration loader; probe paths and ports match a running server; the shard wiring is present
//! in both Kubernetes forms and in compose; grace periods exceed `shutdown.grace_secs`; the alert
//! rules parse as PromQL and name only metrics a running replica exports.
//!
//! No kustomize here: [`render`] builds a kustomization the way kustomize does for exactly the
//! features these files use, and fails on any other, so a new feature cannot slip by unchecked.

use crate::helpers::*;
use crate::journal::sql;
use serde_json::Value;
use settlementd::config::Settings;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// Every YAML document of a file, with merge keys (`<<: *anchor`) applied, as JSON values.
fn yaml_docs(path: &Path) -> Vec<Value> {
    use serde::Deserialize;
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            let mut value = serde_yaml_ng::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
            value.apply_merge().unwrap();
            serde_json::to_value(value).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn yaml(path: &Path) -> Value {
    let mut docs = yaml_docs(path);
    assert_eq!(docs.len(), 1, "{} holds one document", path.display());
    docs.remove(0)
}

fn str_of<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {v}"))
}

/// The objects `kustomize build dir` would print, for the features these files use: resources
/// (files and directories), `replicas`, `configMapGenerator` (literals and files; names without
/// the content hash) and `$patch: delete`.
fn render(dir: &Path) -> Vec<Value> {
    let k = yaml(&dir.join("kustomization.yaml"));
    for key in k.as_object().unwrap().keys() {
        assert!(
            [
                "apiVersion",
                "kind",
                "resources",
                "replicas",
                "configMapGenerator",
                "patches"
            ]
            .contains(&key.as_str()),
            "{}: the test renderer does not know `{key}`; teach it before using it",
            dir.display()
        );
    }
    let mut objects = Vec::new();
    for resource in k["resources"].as_array().into_iter().flatten() {
        let path = dir.join(str_of(resource, "resource"));
        assert!(
            path.exists(),
            "{} lists missing {}",
            dir.display(),
            path.display()
        );
        if path.is_dir() {
            objects.extend(render(&path));
        } else {
            objects.extend(yaml_docs(&path));
        }
    }
    for generator in k["configMapGenerator"].as_array().into_iter().flatten() {
        let mut data = serde_json::Map::new();
        for literal in generator["literals"].as_array().into_iter().flatten() {
            let (key, value) = str_of(literal, "literal").split_once('=').unwrap();
            data.insert(key.into(), value.into());
        }
        for file in generator["files"].as_array().into_iter().flatten() {
            let path = dir.join(str_of(file, "file"));
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            data.insert(str_of(file, "file").into(), text.into());
        }
        objects.push(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": generator["name"]}, "data": data,
        }));
    }
    for replicas in k["replicas"].as_array().into_iter().flatten() {
        let target = objects
            .iter_mut()
            .find(|o| o["metadata"]["name"] == replicas["name"] && o["spec"].is_object())
            .unwrap_or_else(|| panic!("replicas names no resource: {replicas}"));
        target["spec"]["replicas"] = replicas["count"].clone();
    }
    for patch in k["patches"].as_array().into_iter().flatten() {
        let body: Value = serde_yaml_ng::from_str(str_of(&patch["patch"], "patch")).unwrap();
        assert_eq!(body["$patch"], "delete", "only deletions are rendered here");
        let before = objects.len();
        objects.retain(|o| {
            !(o["kind"] == body["kind"] && o["metadata"]["name"] == body["metadata"]["name"])
        });
        assert_eq!(
            objects.len(),
            before - 1,
            "the patch deletes nothing: {body}"
        );
    }
    objects
}

fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name}"))
}

fn pod_spec(workload: &Value) -> &Value {
    match str_of(&workload["kind"], "kind") {
        "CronJob" => &workload["spec"]["jobTemplate"]["spec"]["template"]["spec"],
        _ => &workload["spec"]["template"]["spec"],
    }
}

fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// Variables the binary reads besides `SETTLEMENTD__…` (PGSSLROOTCERT: libpq's sslrootcert).
const OTHER_VARIABLES: &[&str] = &["POD_NAME", "PGSSLROOTCERT"];

/// What a deploy file gives one settlementd process, loaded by the binary's own loader.
struct Process {
    what: String,
    settings: Settings,
    /// The environment as the process sees it (values from the downward API filled in).
    env: BTreeMap<String, String>,
    /// `database.password_file` as the file sets it, before the test points it at a stand-in.
    password_file: Option<String>,
}

/// Loads `env` (and the config file, when one is passed) with the real loader. Files the settings
/// name as secrets are replaced by stand-ins; the caller checks where the real ones come from.
fn load(what: &str, config: Option<&str>, env: BTreeMap<String, String>) -> Process {
    for key in env.keys() {
        assert!(
            key.starts_with("SETTLEMENTD__") || OTHER_VARIABLES.contains(&key.as_str()),
            "{what}: {key} is not a variable settlementd reads"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let config_path = config.map(|text| {
        let path = dir.path().join("settlementd.toml");
        std::fs::write(&path, text).unwrap();
        path
    });
    let from_file = config_path.as_ref().and_then(|path| {
        config::Config::builder()
            .add_source(config::File::from(path.as_path()))
            .build()
            .unwrap()
            .get_string("database.password_file")
            .ok()
    });
    let password_file = env
        .get("SETTLEMENTD__DATABASE__PASSWORD_FILE")
        .cloned()
        .or(from_file);
    let stand_in = dir.path().join("password");
    std::fs::write(&stand_in, "stand-in\n").unwrap();
    let mut loaded = env.clone();
    if password_file.is_some() {
        loaded.insert(
            "SETTLEMENTD__DATABASE__PASSWORD_FILE".into(),
            stand_in.to_str().unwrap().into(),
        );
    }
    let settings = Settings::load_from(config_path.as_deref(), loaded)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    Process {
        what: what.into(),
        settings,
        env,
        password_file,
    }
}

/// A Kubernetes container as settlementd sees it: env (downward API values filled in as the pod
/// with index 1 would get them), `envFrom` ConfigMaps, and the `--config` file from its ConfigMap.
fn kube_process(objects: &[Value], workload: &Value, name: &str) -> Process {
    let pod = pod_spec(workload);
    let c = container(pod, name);
    let mut env = BTreeMap::new();
    for from in c["envFrom"].as_array().into_iter().flatten() {
        let cm = object(
            objects,
            "ConfigMap",
            str_of(&from["configMapRef"]["name"], "envFrom"),
        );
        for (k, v) in cm["data"].as_object().unwrap() {
            env.insert(k.clone(), str_of(v, k).to_string());
        }
    }
    for var in c["env"].as_array().into_iter().flatten() {
        let value = match (
            &var["value"],
            var["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        ) {
            (Value::String(v), _) => v.clone(),
            (_, Some("metadata.name")) => "settlementd-1".into(),
            (_, Some(path)) if path.contains("index") => "1".into(),
            other => panic!("unexpected env source {other:?}"),
        };
        env.insert(str_of(&var["name"], "env name").into(), value);
    }
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| str_of(a, "arg"))
        .collect();
    let config = args.iter().position(|a| *a == "--config").map(|i| {
        let path = Path::new(args[i + 1]);
        let mount = mount_of(pod, c, path);
        let cm = object(
            objects,
            "ConfigMap",
            str_of(&mount["configMap"]["name"], "volume"),
        );
        let file = path.file_name().unwrap().to_str().unwrap();
        str_of(&cm["data"][file], file).to_string()
    });
    let what = format!(
        "{}/{} container {name}",
        workload["kind"], workload["metadata"]["name"]
    );
    let process = load(&what, config.as_deref(), env);
    if let Some(file) = &process.password_file {
        let volume = mount_of(pod, c, Path::new(file));
        assert!(
            volume["secret"]["secretName"].is_string(),
            "{what}: {file} is not a Secret"
        );
    }
    process
}

/// The pod volume mounted into `c` at the directory holding `path`.
fn mount_of<'a>(pod: &'a Value, c: &Value, path: &Path) -> &'a Value {
    let dir = path.parent().unwrap().to_str().unwrap();
    let mount = c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["mountPath"] == dir)
        .unwrap_or_else(|| panic!("nothing is mounted at {dir}"));
    pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("no volume {}", mount["name"]))
}

/// `file` is a compose secret that `service` mounts and the file defines.
fn assert_compose_secret(compose: &Value, name: &str, service: &Value, file: &str) {
    let secret = file
        .strip_prefix("/run/secrets/")
        .expect("a compose secret");
    assert!(
        service["secrets"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s == secret),
        "{name} does not mount {secret}"
    );
    assert!(compose["secrets"][secret]["file"].is_string(), "{secret}");
}

/// Compose's services that run the settlementd image, by name.
fn compose_processes() -> BTreeMap<String, (Process, Value)> {
    let compose = yaml(&deploy_dir().join("compose.yaml"));
    let mut out = BTreeMap::new();
    for (name, service) in compose["services"].as_object().unwrap() {
        if service["image"] != "settlementd:latest" {
            continue;
        }
        let env = service["environment"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), str_of(v, k).to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let process = load(&format!("compose service {name}"), None, env);
        if let Some(file) = &process.password_file {
            assert_compose_secret(&compose, name, service, file);
        }
        out.insert(name.clone(), (process, service.clone()));
    }
    out
}

/// `Key=value` lines of a systemd unit or environment file, in order (repeated keys kept).
fn unit_lines(path: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with('['))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("{l}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn unit_value(lines: &[(String, String)], key: &str) -> String {
    lines
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no {key}="))
}

/// An instance of a systemd unit: its environment files, then its `Environment=` lines with the
/// specifiers `%i` (shard 1), `%H` and `%d` filled in.
fn systemd_process(unit: &str, env_files: &[&str]) -> (Process, Vec<(String, String)>) {
    let dir = deploy_dir().join("systemd");
    let lines = unit_lines(&dir.join(unit));
    let mut env = BTreeMap::new();
    for file in env_files {
        let named = lines.iter().any(|(k, v)| {
            k == "EnvironmentFile"
                && v.trim_start_matches('-') == format!("/etc/settlementd/{file}")
        });
        assert!(named, "{unit} does not read {file}");
        env.extend(unit_lines(&dir.join(file)));
    }
    for (_, assignment) in lines.iter().filter(|(k, _)| k == "Environment") {
        let (k, v) = assignment.split_once('=').unwrap();
        let v = v
            .replace("%i", "1")
            .replace("%H", "host")
            .replace("%d", "/run/credentials/x");
        env.insert(k.to_string(), v);
    }
    let process = load(unit, None, env);
    (process, lines)
}

fn base() -> Vec<Value> {
    render(&deploy_dir().join("kubernetes"))
}

fn cronjob_overlay() -> Vec<Value> {
    render(&deploy_dir().join("kubernetes-cronjob"))
}

/// The replicas' container (StatefulSet) or the runs' (CronJob) of rendered `objects`.
fn workload_process(objects: &[Value], kind: &str) -> Process {
    kube_process(objects, object(objects, kind, "settlementd"), "settlementd")
}

fn migrate_job_process(objects: &[Value]) -> Process {
    kube_process(
        objects,
        object(objects, "Job", "settlementd-migrate"),
        "migrate",
    )
}

fn systemd_instance() -> (Process, Vec<(String, String)>) {
    systemd_process("settlementd@.service", &["settlementd.env"])
}

fn systemd_migrate() -> Process {
    systemd_process(
        "settlementd-migrate.service",
        &["settlementd.env", "settlementd-migrate.env"],
    )
    .0
}

#[test]
fn every_deploy_file_parses() {
    let mut seen = 0;
    let mut dirs = vec![deploy_dir()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                let docs = yaml_docs(&path);
                assert!(!docs.is_empty(), "{} is empty", path.display());
                for doc in &docs {
                    let kube = doc["apiVersion"].is_string();
                    assert!(
                        !kube
                            || doc["kind"].is_string()
                                && (doc["kind"] == "Kustomization"
                                    || doc["metadata"]["name"].is_string()),
                        "{}: a Kubernetes object needs kind and metadata.name",
                        path.display()
                    );
                }
                seen += 1;
            }
        }
    }
    assert!(seen >= 10, "only {seen} YAML files found");
}

#[test]
fn every_setting_in_the_deploy_files_is_one_the_binary_loads() {
    let base = base();
    let overlay = cronjob_overlay();
    let mut processes = vec![
        workload_process(&base, "StatefulSet"),
        migrate_job_process(&base),
        workload_process(&overlay, "CronJob"),
        migrate_job_process(&overlay),
        systemd_instance().0,
        systemd_migrate(),
    ];
    processes.extend(compose_processes().into_values().map(|(p, _)| p));
    for p in &processes {
        // Every replica and run talks to a database, with a password from a file.
        assert!(
            p.settings.database.url.is_some(),
            "{}: no database URL",
            p.what
        );
        assert!(p.password_file.is_some(), "{}: no password_file", p.what);
        assert!(
            !p.env.contains_key("DATABASE_URL"),
            "{}: a URL in the environment",
            p.what
        );
    }
    assert_eq!(processes.len(), 10);
}

/// (user, host:port/database) of a process's URL.
fn role_and_database(p: &Process) -> (String, String) {
    let url = url::Url::parse(p.settings.database_url().unwrap()).unwrap();
    assert!(
        url.password().is_some(),
        "{}: the password file is applied",
        p.what
    );
    let place = format!("{}:{:?}{}", url.host_str().unwrap(), url.port(), url.path());
    (url.username().to_string(), place)
}

#[test]
fn migrations_run_as_the_migration_role_and_replicas_as_the_runtime_role_on_one_database() {
    let roles = std::fs::read_to_string(deploy_dir().join("sql/roles.sql")).unwrap();
    for role in ["settlementd_app", "settlementd_migrator"] {
        assert!(
            roles.contains(&format!("CREATE ROLE {role} LOGIN")),
            "{role}"
        );
    }
    let base = base();
    let compose = compose_processes();
    let pairs = [
        (
            workload_process(&base, "StatefulSet"),
            migrate_job_process(&base),
        ),
        (systemd_instance().0, systemd_migrate()),
    ];
    let compose_pair = (&compose["settlementd-0"].0, &compose["migrate"].0);
    for (app, migrator) in pairs.iter().map(|(a, m)| (a, m)).chain([compose_pair]) {
        let (app_role, app_db) = role_and_database(app);
        let (migrator_role, migrator_db) = role_and_database(migrator);
        assert_eq!(
            (app_role.as_str(), migrator_role.as_str()),
            ("settlementd_app", "settlementd_migrator")
        );
        assert_eq!(app_db, migrator_db, "{} and {}", app.what, migrator.what);
        assert!(
            !app.settings.database.migrate_on_start,
            "{}: the runtime role cannot migrate",
            app.what
        );
    }
    // Different secrets for the two roles.
    let secret = |kind, name| {
        let pod = pod_spec(object(&base, kind, name));
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|v| v["secret"]["secretName"].as_str())
            .unwrap()
            .to_string()
    };
    assert_ne!(
        secret("StatefulSet", "settlementd"),
        secret("Job", "settlementd-migrate")
    );
}

/// Where the workload's settlementd container takes SETTLEMENTD__SHARD__INDEX from (downward API).
fn shard_index_source(workload: &Value) -> &str {
    let env = container(pod_spec(workload), "settlementd")["env"]
        .as_array()
        .unwrap();
    let index = env
        .iter()
        .find(|e| e["name"] == "SETTLEMENTD__SHARD__INDEX")
        .expect("SETTLEMENTD__SHARD__INDEX is set");
    str_of(&index["valueFrom"]["fieldRef"]["fieldPath"], "fieldPath")
}

#[test]
fn the_shard_wiring_is_present_in_both_kubernetes_forms_compose_and_systemd() {
    // StatefulSet: the pod index is the shard; the count sits beside the replica count, once.
    let base = base();
    let sts = object(&base, "StatefulSet", "settlementd");
    let p = kube_process(&base, sts, "settlementd");
    assert_eq!(
        shard_index_source(sts),
        "metadata.labels['apps.kubernetes.io/pod-index']"
    );
    assert_eq!(p.settings.shard.index, 1);
    assert_eq!(
        sts["spec"]["replicas"],
        Value::from(p.settings.shard.count),
        "replicas = shard count"
    );
    assert!(
        yaml(&deploy_dir().join("kubernetes/statefulset.yaml"))["spec"]["replicas"].is_null(),
        "the replica count is set in kustomization.yaml only"
    );
    let toml = std::fs::read_to_string(deploy_dir().join("kubernetes/settlementd.toml")).unwrap();
    assert!(
        !toml.contains("[shard]"),
        "the shard count is set in kustomization.yaml only"
    );

    // CronJob: an Indexed Job; the completion index is the shard, completions the count.
    let overlay = cronjob_overlay();
    assert!(overlay
        .iter()
        .all(|o| o["kind"] != "StatefulSet" && o["kind"] != "Service"));
    let cron = object(&overlay, "CronJob", "settlementd");
    let p = kube_process(&overlay, cron, "settlementd");
    let job = &cron["spec"]["jobTemplate"]["spec"];
    assert_eq!(job["completionMode"], "Indexed");
    assert_eq!(job["completions"], Value::from(p.settings.shard.count));
    assert_eq!(job["parallelism"], job["completions"]);
    assert!(job["backoffLimitPerIndex"].as_u64().unwrap() > 0);
    assert_eq!(pod_spec(cron)["restartPolicy"], "Never");
    assert_eq!(
        shard_index_source(cron),
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    );
    assert_eq!(p.settings.shard.index, 1);
    assert_eq!(cron["spec"]["concurrencyPolicy"], "Forbid");
    assert_eq!(cron["spec"]["timeZone"], "Asia/Shanghai");
    assert_eq!(
        cron["spec"]["timeZone"],
        p.settings.schedule.timezone.name(),
        "run settles last month in schedule.timezone"
    );
    assert_eq!(
        format!("0 {}", str_of(&cron["spec"]["schedule"], "schedule")),
        settlement_cron(&p.settings).pattern.to_string(),
        "the CronJob fires at the instant of schedule.cron"
    );
    let args = &container(pod_spec(cron), "settlementd")["args"];
    assert!(args.as_array().unwrap().iter().any(|a| a == "run"));

    // One CronJob runs every enabled job of the registry, followers waiting for their leader.
    let args: Vec<&str> = args
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.contains(&"--all-jobs") && args.contains(&"--wait"),
        "{args:?}"
    );
    let every_job = settlementd::jobs::build(&p.settings);
    assert!(
        every_job.iter().all(|j| j.schedule().enabled),
        "the CronJob's configuration disables a job"
    );

    // Compose: three replicas, indexes 0..count, one count.
    let replicas: Vec<_> = compose_processes()
        .into_values()
        .filter(|(p, _)| p.env.contains_key("SETTLEMENTD__SHARD__INDEX"))
        .map(|(p, _)| (p.settings.shard.index, p.settings.shard.count))
        .collect();
    assert_eq!(replicas, [(0, 3), (1, 3), (2, 3)]);

    // systemd: the instance name is the shard.
    let (p, lines) = systemd_instance();
    assert!(lines.contains(&("Environment".into(), "SETTLEMENTD__SHARD__INDEX=%i".into())));
    assert_eq!(p.settings.shard.index, 1);
}

#[test]
fn every_grace_period_exceeds_shutdown_grace_secs() {
    let base = base();
    let overlay = cronjob_overlay();
    for (objects, kind, name) in [
        (&base, "StatefulSet", "settlementd"),
        (&overlay, "CronJob", "settlementd"),
    ] {
        let workload = object(objects, kind, name);
        let p = kube_process(objects, workload, "settlementd");
        let period = pod_spec(workload)["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap();
        assert!(period > p.settings.shutdown.grace_secs, "{kind}: {period}");
    }
    for (p, service) in compose_processes().into_values() {
        if p.env.contains_key("SETTLEMENTD__SHARD__INDEX") {
            let period = str_of(&service["stop_grace_period"], "stop_grace_period");
            let secs: u64 = period.trim_end_matches('s').parse().unwrap();
            assert!(
                secs > p.settings.shutdown.grace_secs,
                "{}: {period}",
                p.what
            );
        }
    }
    let (p, lines) = systemd_instance();
    assert_eq!(unit_value(&lines, "KillSignal"), "SIGTERM");
    let stop: u64 = unit_value(&lines, "TimeoutStopSec").parse().unwrap();
    assert!(
        stop > p.settings.shutdown.grace_secs,
        "TimeoutStopSec={stop}"
    );
}

#[tokio::test]
async fn probe_paths_and_ports_match_the_server() {
    let base = base();
    let sts = object(&base, "StatefulSet", "settlementd");
    let p = kube_process(&base, sts, "settlementd");
    let port = p.settings.http.listen.port();
    let c = container(pod_spec(sts), "settlementd");
    assert_eq!(c["ports"][0]["containerPort"], Value::from(port));
    let port_name = &c["ports"][0]["name"];
    let mut paths = BTreeSet::new();
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(&c[probe]["httpGet"]["port"], port_name);
        paths.insert(str_of(&c[probe]["httpGet"]["path"], probe).to_string());
    }
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    let service = object(&base, "Service", "settlementd");
    assert_eq!(&service["spec"]["ports"][0]["targetPort"], port_name);
    let annotations = &service["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/port"], port.to_string());
    paths.insert(str_of(&annotations["prometheus.io/path"], "path").to_string());
    let monitor = yaml(&deploy_dir().join("kubernetes/servicemonitor.yaml"));
    assert_eq!(
        &monitor["spec"]["endpoints"][0]["port"],
        &service["spec"]["ports"][0]["name"]
    );
    paths.insert(str_of(&monitor["spec"]["endpoints"][0]["path"], "path").to_string());

    for (p, service) in compose_processes().into_values() {
        let Some(health) = service["healthcheck"]["test"].as_array() else {
            continue;
        };
        let port = p.settings.http.listen.port();
        let command = str_of(health.last().unwrap(), "healthcheck");
        assert!(
            command.contains(&format!("/dev/tcp/127.0.0.1/{port}")),
            "{command}"
        );
        assert!(command.contains("GET /readyz "), "{command}");
        let published = str_of(&service["ports"][0], "ports");
        assert!(published.ends_with(&format!(":{port}")), "{published}");
    }
    let (p, _) = systemd_instance();
    assert_eq!(p.settings.http.listen.port(), port);

    // Every path the files name answers 200 on a real server.
    let db = test_db().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(settlementd::daemon::http::run(
        listener,
        http_state(
            &db.pool,
            settlementd::config::Settings::load_from(None, []).unwrap(),
        ),
        stop.clone().cancelled_owned(),
    ));
    for path in &paths {
        assert_eq!(get(addr, path).await.unwrap().0, 200, "{path}");
    }
    stop.cancel();
    server.await.unwrap().unwrap();
}

/// Metric names an expression selects (histogram series suffixes kept).
fn metrics_of(expr: &str) -> BTreeSet<String> {
    use promql_parser::parser::Expr;
    use promql_parser::util::{walk_expr, ExprVisitor};
    struct Names(BTreeSet<String>);
    impl ExprVisitor for Names {
        type Error = std::convert::Infallible;
        fn pre_visit(&mut self, expr: &Expr) -> Result<bool, Self::Error> {
            let selector = match expr {
                Expr::VectorSelector(vs) => Some(vs),
                Expr::MatrixSelector(ms) => Some(&ms.vs),
                _ => None,
            };
            if let Some(vs) = selector {
                self.0
                    .insert(vs.name.clone().expect("selectors name their metric"));
            }
            Ok(true)
        }
    }
    let ast = promql_parser::parser::parse(expr).unwrap_or_else(|e| panic!("{expr}: {e}"));
    let mut names = Names(BTreeSet::new());
    walk_expr(&mut names, &ast).unwrap();
    names.0
}

/// The metric names in a Prometheus text exposition (histograms by their base name too).
fn exported(body: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name = line.split(['{', ' ']).next().unwrap().to_string();
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix) {
                names.insert(base.to_string());
            }
        }
        names.insert(name);
    }
    names
}

/// The value of the series `name` (a metric's name, with its labels when it has any, as exported:
/// `settlementd_shards`, `settlementd_paused{job_name="fine-settlement"}`).
fn sample(body: &str, name: &str) -> f64 {
    body.lines()
        .find(|l| l.rsplit_once(' ').map(|(series, _)| series) == Some(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample of {name} in:\n{body}"))
}

/// The settlement's shards of the latest fire's month not SUCCESS, as exported.
const UNSETTLED_SHARDS: &str =
    "settlementd_latest_fire_shards_not_success{job_name=\"fine-settlement\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_alert_rules_parse_and_name_only_metrics_a_running_replica_exports() {
    let rules = yaml(&deploy_dir().join("prometheus/alerts.yaml"));
    let operations = std::fs::read_to_string(deploy_dir().join("../docs/OPERATIONS.md")).unwrap();
    let anchors = markdown_anchors(&operations);
    let mut used = BTreeSet::new();
    // Metrics of the alerts that group by `job_name`: each must carry that label.
    let mut per_job = BTreeSet::new();
    let mut alerts = BTreeSet::new();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let name = str_of(&rule["alert"], "alert");
            assert!(alerts.insert(name.to_string()), "{name} twice");
            let expr = str_of(&rule["expr"], name);
            used.extend(metrics_of(expr));
            if expr.contains("job_name") {
                per_job.extend(metrics_of(expr));
            }
            assert!(rule["labels"]["severity"].is_string(), "{name}: severity");
            for key in ["summary", "description", "runbook"] {
                assert!(rule["annotations"][key].is_string(), "{name}: {key}");
            }
            let runbook = str_of(&rule["annotations"]["runbook"], name);
            let anchor = runbook
                .strip_prefix("docs/OPERATIONS.md#")
                .unwrap_or_else(|| {
                    panic!("{name}: runbook {runbook} is not in docs/OPERATIONS.md")
                });
            assert!(
                anchors.contains(anchor),
                "{name}: docs/OPERATIONS.md has no section #{anchor}"
            );
        }
    }
    for required in [
        "SettlementMonthNotClosed",
        "SettlementFencingRejections",
        "SettlementRunFailingRepeatedly",
        "SettlementReplicaNotReady",
        "SettlementMonthsNotClosed",
        "SettlementUnsettledBeyondLookback",
        "SettlementCorrectionUnfinished",
        "SettlementPausedAcrossFire",
    ] {
        assert!(alerts.contains(required), "{required} missing");
    }

    // Shard 0 of 2 runs alone: it settles its part of the latest month at start-up (catch-up), and
    // every metric is then exported, the latest month showing shard 1 still unsettled.
    let db = test_db().await;
    let replica = ServeProcess::start(
        &db.url,
        &[
            ("SETTLEMENTD__SHARD__INDEX", "0"),
            ("SETTLEMENTD__SHARD__COUNT", "2"),
        ],
    );
    replica.wait_for("/readyz", 200).await;
    // The liveness task publishes its gauges (`settlementd_shards_by_owners`, …) at its first
    // report, a heartbeat after start, which on a loaded machine may come after the run's.
    let mut body = String::new();
    for _ in 0..300 {
        body = replica.wait_for("/metrics", 200).await;
        let all = exported(&body);
        if body.contains(&format!("{UNSETTLED_SHARDS} 1"))
            && body.contains(
                "settlementd_last_success_timestamp_seconds{job_name=\"fine-settlement\"}",
            )
            && used.iter().all(|m| all.contains(m))
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let exported = exported(&body);
    for metric in &used {
        assert!(
            exported.contains(metric),
            "the rules name {metric}, which the binary does not export:\n{body}"
        );
    }
    for metric in &per_job {
        assert!(
            body.contains(&format!("{metric}{{job_name=\"fine-settlement\"")),
            "an alert groups {metric} by job_name, which it does not carry:\n{body}"
        );
    }
    assert_eq!(sample(&body, UNSETTLED_SHARDS), 1.0);
    assert_eq!(sample(&body, "settlementd_shards"), 2.0);
    assert_eq!(sample(&body, "settlementd_ready"), 1.0);
    let fire = sample(
        &body,
        "settlementd_latest_fire_timestamp_seconds{job_name=\"fine-settlement\"}",
    );
    assert!(fire > 0.0 && fire <= chrono::Utc::now().timestamp() as f64);

    // Compose's health check, run as compose would, against this replica.
    let compose = yaml(&deploy_dir().join("compose.yaml"));
    let test = compose["services"]["settlementd-0"]["healthcheck"]["test"]
        .as_array()
        .unwrap();
    assert_eq!(test[..3], [Value::from("CMD"), "bash".into(), "-c".into()]);
    let command =
        str_of(&test[3], "healthcheck").replace("/9464", &format!("/{}", replica.addr.port()));
    let status = std::process::Command::new("bash")
        .arg("-c")
        .arg(&command)
        .status()
        .unwrap();
    assert!(
        status.success(),
        "compose's health check fails against a ready replica"
    );
}

#[test]
fn the_systemd_units_pass_systemd_analyze_verify_where_it_is_installed() {
    let Ok(version) = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
    else {
        eprintln!("systemd-analyze is not installed: the units were only parsed");
        return;
    };
    assert!(version.status.success());
    let dir = tempfile::tempdir().unwrap();
    for unit in ["settlementd@.service", "settlementd-migrate.service"] {
        let text = std::fs::read_to_string(deploy_dir().join("systemd").join(unit)).unwrap();
        // verify checks that ExecStart's program exists: point it at the binary under test.
        let text = text.replace(
            "/usr/local/bin/settlementd",
            env!("CARGO_BIN_EXE_settlementd"),
        );
        std::fs::write(dir.path().join(unit), text).unwrap();
    }
    let out = std::process::Command::new("systemd-analyze")
        .args([
            "verify",
            "--man=no",
            "./settlementd@0.service",
            "./settlementd-migrate.service",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.trim().is_empty(), "{stderr}");
}

/// `sslmode` and the root certificate file a process's database URL asks for (the URL's
/// `sslrootcert`, else `PGSSLROOTCERT`).
fn tls_of(p: &Process) -> (String, String) {
    let url = url::Url::parse(p.settings.database_url().unwrap()).unwrap();
    let param = |name: &str| {
        url.query_pairs()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.into_owned())
    };
    let root = param("sslrootcert").or_else(|| p.env.get("PGSSLROOTCERT").cloned());
    (
        param("sslmode").unwrap_or_default(),
        root.unwrap_or_else(|| panic!("{}: no sslrootcert", p.what)),
    )
}

/// Every form asks for verified TLS and mounts the CA its URL names the way it mounts the
/// password: a ConfigMap file on Kubernetes, a compose secret, a systemd credential.
#[test]
fn every_form_verifies_the_database_server_against_a_mounted_ca() {
    let base = base();
    let overlay = cronjob_overlay();
    for (objects, kind, name, container_name) in [
        (&base, "StatefulSet", "settlementd", "settlementd"),
        (&base, "Job", "settlementd-migrate", "migrate"),
        (&overlay, "CronJob", "settlementd", "settlementd"),
    ] {
        let workload = object(objects, kind, name);
        let p = kube_process(objects, workload, container_name);
        let (mode, root) = tls_of(&p);
        assert_eq!(mode, "verify-full", "{}", p.what);
        let pod = pod_spec(workload);
        let mount = container(pod, container_name)["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == root.as_str())
            .unwrap_or_else(|| panic!("{}: {root} is not mounted", p.what));
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        assert_eq!(
            volume["configMap"]["name"], "settlementd-db-ca",
            "{}",
            p.what
        );
        let file = Path::new(&root).file_name().unwrap().to_str().unwrap();
        assert_eq!(mount["subPath"], file, "{}", p.what);
    }
    let compose = yaml(&deploy_dir().join("compose.yaml"));
    for (name, (p, service)) in compose_processes() {
        let (mode, root) = tls_of(&p);
        assert_eq!(mode, "verify-full", "{name}");
        assert_compose_secret(&compose, &name, &service, &root);
    }
    for (unit, files) in [
        ("settlementd@.service", &["settlementd.env"][..]),
        (
            "settlementd-migrate.service",
            &["settlementd.env", "settlementd-migrate.env"][..],
        ),
    ] {
        let (p, lines) = systemd_process(unit, files);
        let (mode, root) = tls_of(&p);
        assert_eq!(mode, "verify-full", "{unit}");
        let credential = root
            .strip_prefix("/run/credentials/x/")
            .expect("a credential");
        assert!(
            lines
                .iter()
                .any(|(k, v)| k == "LoadCredential" && v.starts_with(&format!("{credential}:"))),
            "{unit} does not load {credential}"
        );
    }
}

/// The NetworkPolicy selects the replicas' pods (not the migration Job's) and admits their HTTP
/// port alone, from named sources only.
#[test]
fn the_network_policy_admits_only_the_replicas_http_port_from_named_sources() {
    let base = base();
    let policy = object(&base, "NetworkPolicy", "settlementd");
    let selects = |workload: &Value| {
        let labels = &pod_spec_labels(workload);
        policy["spec"]["podSelector"]["matchLabels"]
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| &labels[k] == v)
    };
    assert!(selects(object(&base, "StatefulSet", "settlementd")));
    assert!(!selects(object(&base, "Job", "settlementd-migrate")));
    assert_eq!(
        policy["spec"]["policyTypes"],
        serde_json::json!(["Ingress"])
    );
    let sts = object(&base, "StatefulSet", "settlementd");
    let port = &container(pod_spec(sts), "settlementd")["ports"][0];
    let rules = policy["spec"]["ingress"].as_array().unwrap();
    assert!(!rules.is_empty());
    for rule in rules {
        assert_eq!(
            rule["ports"],
            serde_json::json!([{"port": port["name"], "protocol": "TCP"}])
        );
        let from = rule["from"].as_array().expect("sources are named");
        assert!(!from.is_empty());
        for source in from {
            assert!(
                source["podSelector"]["matchLabels"].is_object(),
                "every source names its pods: {source}"
            );
        }
    }
}

fn pod_spec_labels(workload: &Value) -> Value {
    match str_of(&workload["kind"], "kind") {
        "CronJob" => {
            workload["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"].clone()
        }
        _ => workload["spec"]["template"]["metadata"]["labels"].clone(),
    }
}

/// The anchors GitHub gives the headings of a Markdown text (lower case, spaces to `-`, other
/// punctuation dropped).
fn markdown_anchors(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// `deploy/upgrade-check RELEASE [MONTHS]`, the post-upgrade check of OPERATIONS, run as an
/// operator runs it: with `SETTLEMENTD` naming this build and the fleet a real `serve`.
fn upgrade_check(url: &str, args: &[&str]) -> (i32, String) {
    let mut check = std::process::Command::new(deploy_dir().join("upgrade-check"));
    for (key, _) in std::env::vars() {
        if key.starts_with("SETTLEMENTD") || key == "DATABASE_URL" {
            check.env_remove(key);
        }
    }
    let out = check
        .env("SETTLEMENTD", env!("CARGO_BIN_EXE_settlementd"))
        .env("SETTLEMENTD__DATABASE__URL", url)
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// [`upgrade_check`] exits 1 saying `needle`; what it said.
fn upgrade_check_fails(url: &str, args: &[&str], needle: &str) -> String {
    let (code, said) = upgrade_check(url, args);
    assert_eq!(code, 1, "{said}");
    assert!(said.contains(needle), "{needle:?} in:\n{said}");
    said
}

/// After an upgrade the check says yes only when it is so: the binary of the release named, every
/// live replica on it, each shard with one, the latest month verified (held rows are libraryd's,
/// not the upgrade's: exit 6 of `verify` passes). A replica of another release in the fleet, a
/// release that is not the binary's, or a month `verify` finds not right each make it exit 1
/// saying what; a wrong argument exits 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs jq (the check's only tool beyond bash); .ci/run installs it and runs this"]
async fn the_upgrade_check_passes_a_fleet_of_the_release_and_names_each_thing_that_is_not() {
    let db = test_db().await;
    let month = settlementd::calendar::BusinessDate::month_before(chrono::Utc::now().date_naive());
    seed_month(&db.pool, month, 200, 1).await;
    sql(
        &db.pool,
        "ALTER TABLE loans ALTER COLUMN due_on DROP NOT NULL",
    )
    .await;
    sql(&db.pool, "UPDATE loans SET due_on = NULL WHERE id = 7").await;
    run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", &month.to_string()]));
    let replica = ServeProcess::start(&db.url, &[("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1")]);
    replica.wait_for("/readyz", 200).await;
    let release = settlementd::version::VERSION;

    let (code, said) = upgrade_check(&db.url, &[release, "1"]);
    assert_eq!(code, 0, "{said}");
    for line in [
        format!("ok: settlementd {release} "),
        format!("ok: every live replica is on {release} (commit "),
        format!("ok: each of the 1 shard(s) has a live replica of {release}"),
        format!("ok: verify {month}: the money right; "),
    ] {
        assert!(said.contains(&line), "{line:?} in:\n{said}");
    }
    assert!(!said.contains("NOT OK"), "{said}");

    let said = upgrade_check_fails(
        &db.url,
        &["9.9.9", "1"],
        "NOT OK: the binary is 'settlementd ",
    );
    assert!(said.contains("not 9.9.9"), "{said}");

    // A replica of the previous release still reporting: the fleet is mixed.
    sql(
        &db.pool,
        "INSERT INTO replicas (owner, version, commit, jobs, shards, shard, started_at, seen_at,
                               ready)
         VALUES ('old-pod', '0.2.0', '453d645', ARRAY['fine-settlement'], 1, 0, now(), now(), true)",
    )
    .await;
    upgrade_check_fails(
        &db.url,
        &[release, "1"],
        &format!("NOT OK: the fleet is mixed: old-pod on 0.2.0 (not {release})"),
    );
    sql(&db.pool, "DELETE FROM replicas WHERE owner = 'old-pod'").await;

    // A settled fine changed behind settlementd's back (its triggers off): verify says not right.
    sqlx::raw_sql(
        "ALTER TABLE loans DISABLE TRIGGER USER;
         UPDATE loans SET fine_cents = fine_cents + 100
          WHERE id = (SELECT min(id) FROM loans WHERE fine_settled_at IS NOT NULL);
         DO $$
         DECLARE t text;
         BEGIN
             FOR t IN SELECT tgname FROM pg_catalog.pg_trigger
                       WHERE tgrelid = 'public.loans'::regclass AND NOT tgisinternal
             LOOP
                 EXECUTE format('ALTER TABLE public.loans ENABLE ALWAYS TRIGGER %I', t);
             END LOOP;
         END $$;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    upgrade_check_fails(
        &db.url,
        &[release, "1"],
        &format!("NOT OK: verify {month}: "),
    );

    for args in [
        &[][..],
        &[release, "0"],
        &[release, "x"],
        &[release, "1", "2"],
    ] {
        let (code, said) = upgrade_check(&db.url, args);
        assert_eq!(code, 2, "{args:?}: {said}");
        assert_eq!(
            said, "usage: deploy/upgrade-check RELEASE [MONTHS]\n",
            "{args:?}"
        );
    }
    drop(replica);
}
