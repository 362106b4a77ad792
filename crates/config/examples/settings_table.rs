//! Print every setting as the Markdown table of `docs/guide/configuration.md`
//! (`cargo run -p granule-config --example settings_table`), grouped by section.

fn main() {
    let defaults = granule_config::Config::default();
    let mut section = "";
    for s in granule_config::SETTINGS {
        let sec = s.key.split('.').next().unwrap_or("");
        if sec != section {
            section = sec;
            println!("\n### `[{sec}]`\n");
            println!("| setting | variable | default | accepts | what it does |");
            println!("|---|---|---|---|---|");
        }
        let default = defaults.get(s.key).unwrap_or_default();
        let default = if default.is_empty() {
            "(empty)".to_string()
        } else {
            format!("`{default}`")
        };
        println!(
            "| `{}` | `{}` | {} | {} | {} |",
            s.key,
            s.env,
            default,
            s.accepts.replace('|', "\\|"),
            s.doc.replace('|', "\\|")
        );
    }
}
